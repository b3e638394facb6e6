"""Key material: generating, parsing and hashing ``tg-`` keys and ``tga-`` admin tokens.

A key is ``<kind>-<prefix>-<secret>``. The prefix is public (it finds the row and is what
logs and the console show); the database stores only HMAC-SHA256(pepper, whole key).
"""

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass

from django.conf import settings

PREFIX_ALPHABET = string.ascii_lowercase + string.digits
SECRET_ALPHABET = string.ascii_letters + string.digits
PREFIX_LENGTH = 8
SECRET_LENGTH = 40  # ~238 bits of entropy

TENANT_KEY = "tg"
ADMIN_TOKEN = "tga"

_KEY_RE = re.compile(rf"^(tga?)-([a-z0-9]{{{PREFIX_LENGTH}}})-([A-Za-z0-9]{{{SECRET_LENGTH}}})$")


@dataclass(frozen=True)
class NewKey:
    """A freshly generated key: the plaintext is only ever held here, once."""

    plaintext: str
    prefix: str
    secret_hash: str


def hash_key(plaintext: str) -> str:
    """The stored form of a key: hex HMAC-SHA256 with the server pepper."""
    pepper = settings.TOLLGATE_KEY_PEPPER.encode()
    return hmac.new(pepper, plaintext.encode(), hashlib.sha256).hexdigest()


def generate_key(kind: str = TENANT_KEY) -> NewKey:
    """A new random key of the given kind with its prefix and hash."""
    prefix = "".join(secrets.choice(PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
    secret = "".join(secrets.choice(SECRET_ALPHABET) for _ in range(SECRET_LENGTH))
    plaintext = f"{kind}-{prefix}-{secret}"
    return NewKey(plaintext=plaintext, prefix=prefix, secret_hash=hash_key(plaintext))


def parse_key(presented: str, kind: str = TENANT_KEY) -> str | None:
    """The prefix of a well-formed key of ``kind``, or None."""
    match = _KEY_RE.fullmatch(presented)
    if not match or match.group(1) != kind:
        return None
    return match.group(2)


_DUMMY_HASH = "0" * 64


def verify_key(presented: str, stored_hash: str | None) -> bool:
    """Constant-time check of a presented key against a stored hash.

    With no stored hash (unknown prefix) the same work is done against a dummy, so an
    attacker cannot tell a wrong prefix from a wrong secret by timing.
    """
    computed = hash_key(presented)
    return hmac.compare_digest(computed, stored_hash or _DUMMY_HASH) and stored_hash is not None
