"""Log filters: no API key or admin token ever reaches a log line."""

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
