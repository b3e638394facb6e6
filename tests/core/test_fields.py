"""Secrets Tollgate stores are encrypted at rest and readable only with the right key."""

import pytest
from django.db import connection

from core.fields import decrypt, encrypt
from deployments.models import Deployment

pytestmark = pytest.mark.django_db


def test_round_trip_and_wrong_key(settings: object) -> None:
    stored = encrypt("upstream-secret")
    assert stored.startswith("fernet:") and "upstream-secret" not in stored
    assert decrypt(stored) == "upstream-secret"
    settings.TOLLGATE_ENCRYPTION_KEY = "another key"
    with pytest.raises(ValueError, match="cannot be read"):
        decrypt(stored)


def test_external_engine_key_is_ciphertext_in_the_database(public_model: object) -> None:
    deployment = Deployment.objects.create(
        name="ext",
        model=public_model,
        image="tollgate/engine-sim:latest",
        external=True,
        external_url="http://127.0.0.1:9/v1",
        upstream_key="sk-upstream-1234567890",
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT upstream_key FROM deployments_deployment WHERE id = %s", [deployment.pk]
        )
        raw = cursor.fetchone()[0]
    assert raw.startswith("fernet:") and "sk-upstream" not in raw
    assert Deployment.objects.get(pk=deployment.pk).upstream_key == "sk-upstream-1234567890"
