"""The container health check and the guarantee that no key reaches a log line."""

import logging

import pytest
from django.test import Client, override_settings

from config.logging import RedactSecretsFilter, redact
from core.redis import get_redis
from tenants.keys import generate_key


@pytest.mark.django_db
def test_healthz_is_ok_when_database_and_redis_answer(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_healthz_names_redis_when_it_is_unreachable(client: Client) -> None:
    get_redis.cache_clear()
    try:
        with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
            response = client.get("/healthz")
    finally:
        get_redis.cache_clear()
    assert response.status_code == 503
    assert set(response.json()["failures"]) == {"redis"}


def test_redaction_keeps_the_prefix_and_drops_the_secret() -> None:
    key, token = generate_key("tg"), generate_key("tga")
    text = redact(f"auth failed for {key.plaintext} and {token.plaintext}.")
    assert key.plaintext not in text and token.plaintext not in text
    assert f"tg-{key.prefix}-…" in text and f"tga-{token.prefix}-…" in text


def test_log_filter_rewrites_records_with_arguments() -> None:
    key = generate_key("tg")
    logger = logging.getLogger("tollgate.test")
    record = logger.makeRecord(
        "tollgate.test", logging.WARNING, __file__, 1, "bad key %s", (key.plaintext,), None
    )
    RedactSecretsFilter().filter(record)
    assert key.plaintext not in record.getMessage()
    assert f"tg-{key.prefix}-…" in record.getMessage()
