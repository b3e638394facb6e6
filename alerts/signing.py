"""Signing webhook bodies, and checking a signature as a receiver does.

Every delivery carries ``Tollgate-Timestamp: <unix seconds>`` and
``Tollgate-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}.{body}")>``: the timestamp
is signed with the body, so a receiver that refuses old timestamps refuses a replayed
delivery (the Stripe / Standard Webhooks scheme). docs/admins/alerts.md has the receiver's
side as a standalone recipe; ``verify`` here is the same check.
"""

import hashlib
import hmac
import time
from collections.abc import Mapping

SCHEME = "v1"
TIMESTAMP_HEADER = "Tollgate-Timestamp"
SIGNATURE_HEADER = "Tollgate-Signature"
EVENT_HEADER = "Tollgate-Event"
DELIVERY_HEADER = "Tollgate-Delivery"
DEFAULT_TOLERANCE = 300  # seconds a signed timestamp may be away from the receiver's clock


class SignatureError(ValueError):
    """A delivery that must not be trusted; the message says why."""


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``f"{timestamp}.{body}"`` with the endpoint's secret."""
    message = str(int(timestamp)).encode() + b"." + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signature_header(secret: str, timestamp: int, body: bytes) -> str:
    return f"{SCHEME}={sign(secret, timestamp, body)}"


def _header(headers: Mapping[str, str], name: str) -> str:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    raise SignatureError(f"The {name} header is missing.")


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> int:
    """Check a delivery's signature and age; returns its timestamp, or raises SignatureError.

    ``headers`` are the request's (any case). A timestamp more than ``tolerance`` seconds
    old is a replay; one as far in the future is refused too. The signature comparison is
    constant-time; a header may carry several ``v1=`` signatures (any one may match).
    """
    raw = _header(headers, TIMESTAMP_HEADER).strip()
    if not raw.isdigit():
        raise SignatureError(f"{TIMESTAMP_HEADER} is not a number of seconds: {raw[:40]!r}.")
    timestamp = int(raw)
    now = time.time() if now is None else now
    if timestamp < now - tolerance:
        raise SignatureError(
            f"{TIMESTAMP_HEADER} is {int(now - timestamp)} s old (more than {tolerance} s): "
            "refused as a replay."
        )
    if timestamp > now + tolerance:
        raise SignatureError(
            f"{TIMESTAMP_HEADER} is {int(timestamp - now)} s in the future (more than "
            f"{tolerance} s): check the clocks."
        )
    expected = sign(secret, timestamp, body)
    presented = [
        part.strip().partition("=")[2]
        for part in _header(headers, SIGNATURE_HEADER).replace(",", " ").split()
        if part.strip().startswith(f"{SCHEME}=")
    ]
    if not presented:
        raise SignatureError(f"{SIGNATURE_HEADER} holds no {SCHEME}= signature.")
    if not any(hmac.compare_digest(expected, candidate) for candidate in presented):
        raise SignatureError("The signature does not match: wrong secret or altered body.")
    return timestamp
