"""Signing and verifying deliveries: Tollgate's own check (alerts.signing) and the
documented receiver recipe agree, and both refuse tampering, wrong secrets and replays."""

import pytest

from alerts import signing
from tests.alerts.conftest import recipe

SECRET = "whsec_test-secret"
BODY = b'{"event":"test","id":"d1"}'
NOW = 1_795_180_800


def signed_headers(secret: str = SECRET, timestamp: int = NOW, body: bytes = BODY) -> dict:
    return {
        "Tollgate-Timestamp": str(timestamp),
        "Tollgate-Signature": signing.signature_header(secret, timestamp, body),
    }


def test_sign_is_hmac_sha256_of_timestamp_dot_body() -> None:
    import hashlib
    import hmac

    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert signing.sign(SECRET, NOW, BODY) == expected
    assert signing.signature_header(SECRET, NOW, BODY) == f"v1={expected}"


def test_a_good_delivery_is_accepted_by_both_checks() -> None:
    headers = signed_headers()
    assert signing.verify(SECRET, headers, BODY, now=NOW + 10) == NOW
    lowered = {k.lower(): v for k, v in headers.items()}
    assert signing.verify(SECRET, lowered, BODY, now=NOW) == NOW
    assert recipe()["verify_tollgate_webhook"](SECRET, headers, BODY, now=NOW + 10) == NOW


@pytest.mark.parametrize(
    ("case", "headers", "body", "now", "reason"),
    [
        ("tampered body", signed_headers(), BODY.replace(b"test", b"tost"), NOW, "does not match"),
        ("wrong secret", signed_headers(secret="whsec_other"), BODY, NOW, "does not match"),
        ("replayed (old)", signed_headers(), BODY, NOW + 301, "replay"),
        ("future-dated", signed_headers(timestamp=NOW + 301), BODY, NOW, "in the future"),
        ("no timestamp", {"Tollgate-Signature": "v1=00"}, BODY, NOW, "Tollgate-Timestamp"),
        ("no signature", {"Tollgate-Timestamp": str(NOW)}, BODY, NOW, "Tollgate-Signature"),
        (
            "other scheme",
            {"Tollgate-Timestamp": str(NOW), "Tollgate-Signature": "v0=abc"},
            BODY,
            NOW,
            "no v1=",
        ),
    ],
)
def test_bad_deliveries_are_refused_with_a_reason(case, headers, body, now, reason) -> None:
    with pytest.raises(signing.SignatureError, match=reason):
        signing.verify(SECRET, headers, body, now=now)
    receiver = recipe()
    with pytest.raises(receiver["InvalidWebhook"]):
        receiver["verify_tollgate_webhook"](SECRET, headers, body, now=now)


def test_within_tolerance_either_way_is_accepted() -> None:
    assert signing.verify(SECRET, signed_headers(), BODY, now=NOW + 300) == NOW
    assert signing.verify(SECRET, signed_headers(), BODY, now=NOW - 300) == NOW
    assert signing.verify(SECRET, signed_headers(), BODY, tolerance=1000, now=NOW + 900) == NOW


def test_any_of_several_signatures_may_match() -> None:
    headers = signed_headers()
    headers["Tollgate-Signature"] = "v1=" + "0" * 64 + ", " + headers["Tollgate-Signature"]
    assert signing.verify(SECRET, headers, BODY, now=NOW) == NOW
    assert recipe()["verify_tollgate_webhook"](SECRET, headers, BODY, now=NOW) == NOW
