"""Log filters: no API key or admin token ever reaches a log line; a refusal is one line."""

import logging
import re

# tg-<prefix>-<secret> (tenant keys), tga- (admin tokens) and tgj- (node join tokens).
_SECRET = re.compile(r"\b(tg[aj]?-[a-z0-9]{6,16})-[A-Za-z0-9]{16,}")


def redact(text: str) -> str:
    """Replace the secret part of any Tollgate key in text, keeping its public prefix."""
    return _SECRET.sub(r"\1-…", text)


class RedactSecretsFilter(logging.Filter):
    """Rewrites a record's message so that keys are shown by prefix only."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class RefusalsInOneLineFilter(logging.Filter):
    """Drops the traceback from records of refused requests (403), keeping their one line.

    Django logs "Forbidden (Permission denied): /path" with the PermissionDenied's
    traceback attached; a refusal is expected behaviour, not a fault to debug.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "status_code", None) == 403 or record.name.startswith("django.security"):
            record.exc_info, record.exc_text = None, None
        return True
