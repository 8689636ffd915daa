"""Credentials out of everything gaexp records: a URL's password masked wherever the config carries one.

A study's storage may be `postgresql://user:PASSWORD@host/db`, a tracking URI
`https://user:PASSWORD@mlflow.lab`; the config is logged whole (params, config.yaml, Hydra's files)
and printed. `mask` writes any text with each URL's password as `***` (and the values of `password=`,
`token=` and `secret=` query parameters); `reconnectable` turns a masked URL back into one that
connects, without the password, which the driver then takes where its clients keep it (PGPASSWORD or
~/.pgpass for PostgreSQL, an option file for MySQL, MLFLOW_TRACKING_PASSWORD for an MLflow server).
"""

from __future__ import annotations

import logging
import re

MASK = "***"
_USERINFO = re.compile(  # Hydra writes an override's ':' escaped ('\\:'): both forms
    r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*\\?://[^\s:/@'\"\\]*)(?P<sep>\\?:)(?P<secret>[^\s/'\"]+)@")
_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|token|secret|api_key)=)(?P<secret>[^&\s'\"]+)", re.IGNORECASE)


def mask(text: str) -> str:
    """`text` with every URL password (and credential query value) replaced by MASK."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['head']}{m['sep']}{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", text)


def reconnectable(url: str) -> str:
    """A URL as recorded (masked) made to connect again: its masked password left out, for the driver to
    find; a URL that carries none is returned as it is."""
    return url.replace(f":{MASK}@", "@")


def masked_record(record: logging.LogRecord) -> logging.LogRecord:
    """`record` with its message's credentials masked (`mask`)."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record: logging reports it where it is emitted
        return record
    masked = mask(message)
    if masked != message:
        record.msg, record.args = masked, None
    return record


class MaskingFilter(logging.Filter):
    """masked_record as a filter, for one handler or logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        masked_record(record)
        return True


def mask_logs() -> None:
    """Every log record of this process made with its credentials masked, whichever handler then writes it:
    Hydra configures its handlers again when a launcher starts, so a filter on them would be lost. Installed
    once (the record factory wrapped), idempotent."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "masks_credentials", False):
        return

    def masking_factory(*args, **kwargs) -> logging.LogRecord:
        return masked_record(factory(*args, **kwargs))

    masking_factory.masks_credentials = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(masking_factory)
