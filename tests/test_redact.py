"""redact: a URL's password never recorded, the URL still usable."""

import logging

import pytest

from gaexp.redact import MaskingFilter, mask, mask_logs, reconnectable

SECRET = "s3cr3t-PW"


@pytest.mark.parametrize("text,masked", [
    (f"postgresql://alice:{SECRET}@db.example:5432/optuna", "postgresql://alice:***@db.example:5432/optuna"),
    (f"mysql+pymysql://bob:{SECRET}@db/optuna?charset=utf8", "mysql+pymysql://bob:***@db/optuna?charset=utf8"),
    (f"https://team:{SECRET}@mlflow.lab.example", "https://team:***@mlflow.lab.example"),
    (f"redis://:{SECRET}@cache:6379/0", "redis://:***@cache:6379/0"),
    (f"storage: postgresql://alice:p@ss{SECRET}@db/x, done", "storage: postgresql://alice:***@db/x, done"),
    (f"https://host/data.tgz?token={SECRET}&part=1", "https://host/data.tgz?token=***&part=1"),
    (f"- optuna.storage=postgresql://a:{SECRET}@h/db\n- seed=1\n", "- optuna.storage=postgresql://a:***@h/db\n- seed=1\n"),
    (f"- optuna.storage=postgresql\\://a\\:{SECRET}@h\\:5432/db", "- optuna.storage=postgresql\\://a\\:***@h\\:5432/db"),
])
def test_a_urls_password_is_masked(text, masked):
    assert mask(text) == masked and SECRET not in mask(text)


@pytest.mark.parametrize("text", ["sqlite:////tmp/outputs/mlflow.db", "http://127.0.0.1:5000", "/tmp/sweep/optuna.journal",
                                  "postgresql://alice@db/optuna", "norm=bn regime=bs4a4", "ratio 3:4 at 10:30"])
def test_text_without_a_password_is_left_as_it_is(text):
    assert mask(text) == text


def test_a_masked_url_reconnects_without_its_password():
    """The driver then takes it where its clients keep it (PGPASSWORD, ~/.pgpass, MLFLOW_TRACKING_PASSWORD)."""
    assert reconnectable(mask(f"postgresql://alice:{SECRET}@db:5432/optuna")) == "postgresql://alice@db:5432/optuna"
    assert reconnectable("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_a_log_line_with_a_password_is_masked_whatever_handler_writes_it(monkeypatch, caplog):
    monkeypatch.setattr(logging, "_logRecordFactory", logging.getLogRecordFactory())  # restored after the test
    mask_logs()
    installed = logging.getLogRecordFactory()
    mask_logs()  # once, however often called
    assert logging.getLogRecordFactory() is installed
    logging.getLogger("hydra.launcher").warning("#0 : optuna.storage=%s", f"postgresql\\://a\\:{SECRET}@h/db")
    assert caplog.messages == ["#0 : optuna.storage=postgresql\\://a\\:***@h/db"]
    record = logging.LogRecord("gaexp", logging.INFO, __file__, 1, "storage %s", (f"postgresql://a:{SECRET}@h/db",), None)
    assert MaskingFilter().filter(record) and record.getMessage() == "storage postgresql://a:***@h/db"
