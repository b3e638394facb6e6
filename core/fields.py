"""Model fields that keep secrets encrypted at rest."""

import base64
import hashlib
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.db import models

PREFIX = "fernet:"


def _fernet() -> Fernet:
    # Derived from its own setting (or the secret key), never stored next to the data.
    material = settings.TOLLGATE_ENCRYPTION_KEY or f"tollgate-fields:{settings.SECRET_KEY}"
    return Fernet(base64.urlsafe_b64encode(hashlib.sha256(material.encode()).digest()))


def encrypt(value: str) -> str:
    return PREFIX + _fernet().encrypt(value.encode()).decode()


def decrypt(stored: str) -> str:
    if not stored.startswith(PREFIX):
        return stored  # written before encryption existed
    try:
        return _fernet().decrypt(stored.removeprefix(PREFIX).encode()).decode()
    except InvalidToken:
        raise ValueError(
            "An encrypted field cannot be read: TOLLGATE_ENCRYPTION_KEY (or DJANGO_SECRET_KEY) "
            "changed."
        ) from None


class EncryptedTextField(models.TextField):
    """Text encrypted with Fernet in the database, plain in Python."""

    def from_db_value(self, value: str | None, expression: Any, connection: Any) -> str | None:
        return decrypt(value) if value else value

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        return encrypt(value) if value else value
