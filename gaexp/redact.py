"""Credentials out of everything gaexp records, prints or writes: a URL's secrets masked wherever they appear.

A study's storage may be `postgresql://user:PASSWORD@host/db`, a tracking URI
`https://user:PASSWORD@mlflow.lab` or `https://TOKEN@host`, a data source `...?sig=...`; the config is logged
whole (params, config.yaml, Hydra's files), printed, and named in errors. `mask` writes any text with each of
these as `***`, reading a URL the way its consumers do:
- the userinfo runs to the *last* `@` before the host, whatever it holds (`/`, quotes, spaces, `@`, `:`, `%`,
  non-ASCII): SQLAlchemy takes the password up to the `@` before the host and urllib the userinfo up to the
  last `@` of the authority, so a mask that stops at a `/` or a quote leaves the rest of it in clear;
- an HTTP(S) userinfo without `:` is a token (`https://TOKEN@host`) and is masked whole; a database URL's
  bare user (`postgresql://alice@db`) is a name, kept;
- the values of the query keys that carry secrets (`SECRET_QUERY_KEYS`: password, token, access_token, sig,
  X-Amz-Signature, apikey, ...).
A masked URL's `***` stands for more than the secret where a line is ambiguous (a later `@` on the same line):
masking too much is safe, too little is not.

`reconnectable` turns a masked URL back into one that connects without the secret, which the driver then
takes where its clients keep it (PGPASSWORD or ~/.pgpass for PostgreSQL, an option file for MySQL,
MLFLOW_TRACKING_USERNAME/PASSWORD for an MLflow server). `mask_logs` masks every log record of the process,
its traceback included; `MaskedStream` every write to the terminal; `private_files` keeps the files a command
writes owner-only while its config holds a secret in clear (Hydra's own folders hold the overrides as typed).
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from typing import IO, Any, Iterable

MASK = "***"
SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "pass", "token", "access_token", "refresh_token", "id_token",
                     "auth_token", "secret", "client_secret", "api_key", "apikey", "api-key", "key", "sig", "signature",
                     "credential", "credentials", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                     "x-goog-signature", "x-goog-credential", "sas", "auth")
_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.\-]*\\?://"  # Hydra writes an override's ':' escaped ('\\:'): both forms
_HOST_START = r"(?=[\w\[%\-.]|\\?:\d)"  # what may follow the `@` that ends a userinfo: a host (or an empty host's port)
# user:secret@host - the secret runs over anything but a line end, to the last '@' of the line that a host follows
_PASSWORD = re.compile(rf"(?P<head>\b{_SCHEME}[^\s:/@'\"\\?#]*)(?P<sep>\\?:)(?P<secret>[^\n\r]*)@{_HOST_START}")
# https://TOKEN@host - HTTP(S) only: a database URL's bare user is a name, not a secret
_TOKEN = re.compile(rf"(?P<head>\b(?:https?|wss?)\\?://)(?P<secret>[^\s:/'\"\\?#]+)@{_HOST_START}", re.IGNORECASE)
_QUERY = re.compile(r"(?P<head>[?&;](?:" + "|".join(re.escape(k) for k in SECRET_QUERY_KEYS) + r")=)(?P<secret>[^&;#\s'\"]+)",
                    re.IGNORECASE)


def mask(text: str) -> str:
    """`text` with every URL password, token-as-user and secret query value replaced by MASK."""
    if not isinstance(text, str):
        text = str(text)
    if "://" not in text and "=" not in text:
        return text
    if "@" in text:
        text = _PASSWORD.sub(lambda m: f"{m['head']}{m['sep']}{MASK}@", text)
        text = _TOKEN.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", text)


def holds_secret(text: str) -> bool:
    """Whether `text` holds a secret `mask` would hide (a masked one, `***`, no longer counts)."""
    return mask(text) != text


def reconnectable(url: str) -> str:
    """A URL as recorded (masked) made to connect again: its masked password or token left out, for the driver
    (or the MLflow client, from MLFLOW_TRACKING_USERNAME/PASSWORD) to find; other URLs are returned as they are."""
    return re.sub(r"(\\?):\*\*\*@", "@", url).replace(f"://{MASK}@", "://")


def masked_exception(exc: BaseException) -> str:
    """`Type: message` of `exc`, masked: the line gaexp shows or records for an error."""
    return mask(f"{type(exc).__name__}: {exc}")


def masked_record(record: logging.LogRecord) -> logging.LogRecord:
    """`record` with its message's credentials masked (`mask`), and its traceback's: formatted here, masked,
    and kept as the text every formatter then writes."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record: logging reports it where it is emitted
        return record
    masked = mask(message)
    if masked != message:
        record.msg, record.args = masked, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        record.exc_text = mask("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
    if record.stack_info:
        record.stack_info = mask(record.stack_info)
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


class MaskedStream:
    """A text stream whose every write is masked (`mask`): the terminal of a gaexp command, whatever prints to
    it (Hydra's own error report, a library's warning, a progress bar). Everything else is the stream's."""

    masks_credentials = True

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def mask_terminal() -> None:
    """sys.stdout and sys.stderr masked (`MaskedStream`), once."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "masks_credentials", False):
            setattr(sys, name, MaskedStream(stream))


def private_files(*texts: str) -> bool:
    """While any of `texts` (a command line, a composed config) holds a secret in clear, every file and folder
    this process and the processes it starts create is its owner's alone (umask 077): Hydra's `.hydra/` files
    hold the overrides and the config as typed. Returns whether it did."""
    if not any(holds_secret(text) for text in texts):
        return False
    os.umask(os.umask(0o077) | 0o077)
    return True
