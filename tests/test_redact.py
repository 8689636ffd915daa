"""redact: a URL's password never recorded, the URL still usable."""

import logging
import os
import random
import string
import subprocess
import sys
from urllib.parse import quote

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from omegaconf.errors import GrammarParseError

from gaexp.redact import MaskingFilter, mask, mask_logs, masked_exception, reconnectable
from hydra_plugins.gaexp_optuna_sweeper._impl import quoted

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


# --- a password of any characters, in every URL form and wherever a URL is written ---------------------------

# any printable character but a line break, the ones a mask that stops early misses among them
PRINTABLE = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))
URL_FORMS = {  # a secret in each form gaexp carries: study storages, tracking URIs, data sources
    "sqlalchemy": ("postgresql+psycopg2://alice:{}@db.example:5432/optuna", "postgresql+psycopg2://alice:***@db.example:5432/optuna"),
    "mysql": ("mysql+pymysql://opt2:{}@127.0.0.1:3399/optuna", "mysql+pymysql://opt2:***@127.0.0.1:3399/optuna"),
    "http": ("https://carol:{}@mlflow.lab.example/", "https://carol:***@mlflow.lab.example/"),
    "http, no user": ("http://:{}@127.0.0.1:5391", "http://:***@127.0.0.1:5391"),
}


def in_contexts(url: str) -> dict[str, str]:
    """`url` where gaexp writes one: as it is, in a log line, in YAML (config.yaml, Hydra's files), as a quoted
    Hydra override (overrides.yaml, a job's command line) and in Hydra's override_dirname (':' escaped). No YAML
    for a URL OmegaConf reads as a broken interpolation (`${` unescaped): no config can hold it, so gaexp never
    writes it there."""
    contexts = {"plain": url, "line": f"error: storage {url} unreachable: timed out",
                "override": f"hydra.sweeper.storage={quoted(url)}",
                "dirname": "hydra.sweeper.storage=" + url.replace(":", "\\:").replace(",", "\\,") + ",seed=1"}
    try:
        contexts["yaml"] = OmegaConf.to_yaml({"optuna": {"storage": url, "study": "t"}})
    except GrammarParseError:
        pass
    return contexts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(password=st.text(PRINTABLE, min_size=1, max_size=24), form=st.sampled_from(sorted(URL_FORMS)))
@example(password="${", form="http")  # found by hypothesis in a run of 2026-12-05: no YAML can hold it unescaped
def test_a_password_of_any_characters_is_masked_in_every_url_form_and_context(password, form):
    template, masked_url = URL_FORMS[form]
    url = template.format(password)
    assert mask(url) == masked_url
    contexts = in_contexts(url)
    assert mask(contexts["line"]) == in_contexts(masked_url)["line"]
    if "yaml" in contexts:
        assert yaml.safe_load(mask(contexts["yaml"]))["optuna"]["storage"] == masked_url  # still the same YAML
    override = OverridesParser.create().parse_override(mask(contexts["override"]))
    assert override.value() == masked_url  # still the same override
    assert mask(contexts["dirname"]).endswith(",seed=1") and "***@" in mask(contexts["dirname"])
    for context, text in contexts.items():
        assume(len(password) >= 4 and password not in in_contexts(masked_url).get(context, ""))
        assert password not in mask(text), context


@given(token=st.text(string.ascii_letters + string.digits + "-_.~", min_size=8, max_size=40),
       key=st.sampled_from(["token", "access_token", "sig", "X-Amz-Signature", "apikey", "api_key", "password",
                            "client_secret", "X-Amz-Security-Token"]))
def test_a_token_as_the_user_or_in_a_query_is_masked(token, key):
    assert mask(f"https://{token}@github.example/org/repo.git") == "https://***@github.example/org/repo.git"
    assert mask(f"https://h.example/data.tgz?part=1&{key}={token}&v=2") == f"https://h.example/data.tgz?part=1&{key}=***&v=2"
    assert reconnectable(mask(f"https://{token}@h.example/x")) == "https://h.example/x"


def drawn_password(rng: random.Random, non_ascii: str = "é€") -> str:
    """A password holding every character a mask has missed (/ ' " @ : % space, non-ASCII) among others."""
    chars = list("/'\"@:% " + non_ascii) + [rng.choice(string.ascii_letters + string.digits + string.punctuation) for _ in range(10)]
    rng.shuffle(chars)
    return "Pw" + "".join(chars) + "Z"


@pytest.mark.slow
def test_a_search_leaves_its_passwords_nowhere_in_mlflow_the_terminal_or_the_reports(tmp_path, server, gaexp_argv):
    """A tiny Optuna search of two trials against a real tracking server. Its study storage carries password A,
    typed on the command line; its tracking URI password B, given as `${oc.env:...}`. Both are percent-encoded
    in their URLs, as a driver needs them: neither the encoded nor the plain form may appear in the server's
    store and artifacts, the terminal, the reports, gaexp-status or gaexp-report; B in no file at all, and the
    files that hold the typed A are their owner's alone."""
    uri, server_root = server
    rng = random.Random(46)
    typed, from_env = drawn_password(rng), drawn_password(rng, "éß")  # HTTP basic auth: Latin-1 (requests)
    storage = f"sqlite:///file:{tmp_path}/optuna.db?mode=rwc&token={quote(typed, safe='')}&uri=true"
    tracking_uri = uri.replace("http://", f"http://bob:{quote(from_env, safe='')}@")
    env = {**os.environ, "GAEXP_TEST_TRACKING_URI": tracking_uri}
    argv = gaexp_argv(tmp_path, "hydra/sweeper=gaexp_optuna", "hydra.sweeper.direction=maximize", "norm=gn4",
                      "regime=bs16a1", "hydra.sweeper.study_name=t", "hydra.sweeper.n_trials=2",
                      "train.lr=tag(log, interval(1e-4, 1e-2))", "data.holdout=1000", f"hydra.sweeper.storage='{storage}'",
                      "mlflow.tracking_uri=${oc.env:GAEXP_TEST_TRACKING_URI}", "mlflow.experiment_name=secrets",
                      "analysis.plots=true")
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, mask(proc.stdout[-2000:] + proc.stderr[-3000:])
    readers = [subprocess.run([sys.executable, "-m", module, "--tracking-uri", tracking_uri, "--experiment", "secrets"],
                              cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
               for module in ("gaexp.progress", "gaexp.analysis")]
    assert readers[0].returncode == 0 and "Optuna search" in readers[0].stdout, readers[0].stderr[-2000:]
    forms = {password: [password, quote(password, safe=""), quote(password)] for password in (typed, from_env)}

    def holds(data: bytes, password: str) -> bool:
        return any(form.encode() in data for form in forms[password])

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    assert len([r for r in runs if r.data.tags.get("optuna.study")]) >= 2  # the trials' runs and the study's
    assert all(r.data.params.get("optuna.storage", "***").count("***") for r in runs if "optuna.storage" in r.data.params)
    for text in (proc.stdout, proc.stderr, *(r.stdout + r.stderr for r in readers)):
        assert not holds(text.encode(), typed) and not holds(text.encode(), from_env)
    for path in server_root.rglob("*"):  # MLflow's store: params, tags, metrics; and every artifact
        if path.is_file():
            assert not holds(path.read_bytes(), typed) and not holds(path.read_bytes(), from_env), path
    owner_only = []
    for path in tmp_path.rglob("*"):  # the sweep's folders, Hydra's files, logs, reports, the Optuna storage
        if path.is_file():
            data = path.read_bytes()
            assert not holds(data, from_env), path
            if holds(data, typed):
                owner_only.append(path)
                assert path.stat().st_mode & 0o077 == 0, f"{path} holds the typed password and others may read it"
    assert any(p.parent.name == ".hydra" for p in owner_only)  # Hydra's own files hold it as typed
    assert not [p for p in owner_only if p.parts[-3:-1] == ("reports",) or p.suffix in (".log", ".txt", ".csv", ".png")]


def test_an_exceptions_text_and_traceback_are_masked_in_every_log_line(monkeypatch):
    """log.exception writes the traceback, whose last line is the exception's own text: a driver's error
    naming its URL. Both are masked before any handler formats them, and so is the line a failed cell leaves
    in FAILED.txt (redact.masked_exception)."""
    import io

    monkeypatch.setattr(logging, "_logRecordFactory", logging.getLogRecordFactory())  # restored after the test
    mask_logs()
    stream = io.StringIO()
    logger = logging.getLogger("gaexp.test_redact")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        try:
            raise ConnectionError(f"cannot connect to mysql+pymysql://opt:Sl4sh/{SECRET}@127.0.0.1:3399/optuna")
        except ConnectionError as e:
            logger.exception("cell %s failed", "norm=bn")
            failed = masked_exception(e)
    finally:
        logger.removeHandler(handler)
    written = stream.getvalue()
    assert SECRET not in written and "Sl4sh" not in written
    assert written.rstrip().endswith("ConnectionError: cannot connect to mysql+pymysql://opt:***@127.0.0.1:3399/optuna")
    assert "Traceback (most recent call last)" in written
    assert failed == "ConnectionError: cannot connect to mysql+pymysql://opt:***@127.0.0.1:3399/optuna"
