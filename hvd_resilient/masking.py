"""The one place that hides credentials, used at every boundary where text leaves a process.

Credentials reach us two ways: inside a URL (`s3://KEY:SECRET@bucket/x`, an endpoint
`http://user:pass@host`) and in variables whose name says so (`AWS_SECRET_ACCESS_KEY`).
Everything that prints, logs or records text passes it through here: CLI error lines and
dry-run output (`mask_text`, `mask_env`), the event log (`scrub`, applied by `EventLog.emit` to
every event), log records (`install_log_scrubber`), the training config as it is recorded
(`TrainConfig.to_dict`) and store errors (`redact_url`). Masking keeps the shape
(`s3://***@bucket/x`) so that a reader still sees which URL, and that it carried a secret.

The URL rule is deliberately wider than RFC 3986: an AWS secret key may hold `/` and `+`, and
written raw into a URL (`s3://AKIA:ab/cd@bucket`) it ends the authority early, so parsers see
host `AKIA`, port `ab` and a path `/cd@bucket`. Text like that is masked too, up to its last
`@`: a path that merely contains an `@` is left alone unless its first segment looks like
`name:secret` (a colon followed by something that is not a port number).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# Name parts (split on anything but letters and digits) that mark a secret value...
_SECRET_WORDS = frozenset({
    "secret", "secrets", "password", "passwd", "pwd", "token", "credential", "credentials",
    "apikey", "passphrase",
})
# ...and word pairs that do (AWS_ACCESS_KEY_ID, aws_session_token, PRIVATE_KEY, API_KEY).
_SECRET_PAIRS = ("access_key", "session_key", "private_key", "api_key", "secret_key")

# `scheme://` then everything up to the last `@` before whitespace, a quote or the next URL.
_URL_AUTH = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<auth>(?:(?!://)[^\s'\"`<>])*)@")
# NAME=value where NAME says "secret" (a command line or an env dump in a message).
_ASSIGN = re.compile(r"\b(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>[^\s'\"]+)")


def is_secret_name(name: str) -> bool:
    """True for `AWS_SECRET_ACCESS_KEY`, `aws_session_token`, `DB_PASSWORD`, `api_key`...;
    False for `tokens_per_second` or `HVD_RESILIENT_CHECKPOINT_URL`."""
    low = str(name).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", low) if w]
    if any(w in _SECRET_WORDS for w in words):
        return True
    joined = "_".join(words)
    return any(p in joined for p in _SECRET_PAIRS)


def _auth_end(auth: str) -> int:
    """How many characters of `auth` (the text between `://` and an `@`) are credentials;
    0 when the `@` is not the end of a userinfo part."""
    cut = len(auth)
    for sep in "/?#":
        i = auth.find(sep)
        if i != -1:
            cut = min(cut, i)
    authority = auth[:cut]
    if cut == len(auth):
        return len(auth)  # no path before the @: it ends the userinfo, whatever it holds
    if "@" in authority:
        return authority.rindex("@")
    # The authority ended early: only credentials written raw (a secret with '/') look like
    # `name:secret` there; `host:8080/a@b` and `bucket/a@b` are a port and a path.
    name, colon, rest = authority.partition(":")
    if colon and name and rest and not rest.isdigit():
        return len(auth)
    return 0


def _mask_match(m: re.Match[str]) -> str:
    auth = m.group("auth")
    end = _auth_end(auth)
    if end == 0:
        return m.group(0)
    return f"{m.group('scheme')}{MASK}{auth[end:]}@"


def mask_text(text: str) -> str:
    """Masks the userinfo of every URL in `text` and the value of every `SECRET_NAME=value`."""
    if not isinstance(text, str):
        text = str(text)
    if "@" in text and "://" in text:
        text = _URL_AUTH.sub(_mask_match, text)
    if "=" in text:
        text = _ASSIGN.sub(
            lambda m: f"{m.group('name')}={MASK}" if is_secret_name(m.group("name"))
            else m.group(0), text)
    return text


def mask_url(url: str) -> str:
    """`s3://KEY:SECRET@bucket/x` -> `s3://***@bucket/x`; a URL without credentials is
    returned unchanged. Never raises, whatever the string."""
    return mask_text(url)


def has_credentials(url: str) -> bool:
    """True when `url` carries a userinfo part (or what would be one, see the module doc)."""
    return isinstance(url, str) and mask_url(url) != url


def mask_value(name: str, value: Any) -> Any:
    """The value of a named setting as it may be shown."""
    if is_secret_name(name) and value not in (None, ""):
        return MASK
    return mask_text(value) if isinstance(value, str) else value


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment as it may be printed: secret names masked, URLs in values masked."""
    return {k: mask_value(k, v) for k, v in env.items()}


def scrub(value: Any) -> Any:
    """A JSON-like structure with secret-named keys masked and every string masked."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, Mapping):
        return {k: (MASK if is_secret_name(str(k)) and v not in (None, "") else scrub(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    return value


# -- log records ---------------------------------------------------------------------------
_installed = False


def install_log_scrubber() -> None:
    """Every log record made in this process from now on (any logger, ours or a library's)
    has its message, and its traceback text, masked. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()
    formatter = logging.Formatter()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: leave it to the handler to report
            return record
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = mask_text(formatter.formatException(record.exc_info))
        return record

    logging.setLogRecordFactory(factory)


class MaskingWriter:
    """A text stream that masks what goes through it (the CLI's stdout and stderr)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask_text(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
