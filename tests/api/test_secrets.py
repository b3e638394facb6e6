"""Keys and admin tokens: shown once, stored as prefix + HMAC only, never logged; and who
the admin API lets in."""

import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import time_machine
from django.db import connection
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from config.logging import RedactSecretsFilter
from tenants import services
from tenants.keys import hash_key
from tenants.models import AdminToken, ApiKey, AuditLog, Tenant
from tests.api.conftest import World, all_rows_text, db_state, router_endpoints, router_lookup_count

KEY_RE = re.compile(r"tg-[a-z0-9]{8}-[A-Za-z0-9]{40}")
TOKEN_RE = re.compile(r"tga-[a-z0-9]{8}-[A-Za-z0-9]{40}")


class RawRecords(logging.Handler):
    """Keeps every record as emitted, before any handler's filter rewrites it.

    The project's RedactSecretsFilter sits on the console handler and rewrites
    ``record.msg`` in place, so a handler running after it (pytest's caplog among them)
    would see an already-redacted message and miss a leak. This one goes first.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        parts = [str(record.msg), repr(record.args), record.getMessage()]
        if record.exc_info:
            parts.append(logging.Formatter().formatException(record.exc_info))
        parts += [repr(v) for k, v in vars(record).items() if k not in {"msg", "args"}]
        self.texts.append("\n".join(parts))


@pytest.fixture
def raw_logs(
    caplog: pytest.LogCaptureFixture,
) -> Iterator[tuple[RawRecords, pytest.LogCaptureFixture]]:
    """Every log record at DEBUG from every logger, including SQL with its parameters."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="django.db.backends")
    handler = RawRecords()
    root = logging.getLogger()
    root.handlers.insert(0, handler)
    forced, connection.force_debug_cursor = connection.force_debug_cursor, True
    try:
        yield handler, caplog
    finally:
        connection.force_debug_cursor = forced
        root.removeHandler(handler)


def _assert_nowhere(secrets: list[str], logs: tuple[RawRecords, pytest.LogCaptureFixture]) -> None:
    handler, caplog = logs
    assert handler.texts, "no log record was captured at all: the capture is broken"
    stored = all_rows_text()
    for secret in secrets:
        assert secret not in stored, "the secret is in the database"
        for text in handler.texts:
            assert secret not in text, "the secret is in a log record"
        assert secret not in caplog.text


def test_a_new_key_is_shown_once_and_stored_as_prefix_and_hmac_only(
    world: World,
    client_for: Callable[..., APIClient],
    raw_logs: tuple[RawRecords, pytest.LogCaptureFixture],
) -> None:
    alice = client_for(world.alice)
    response = alice.post("/api/v1/keys/", {"tenant": "acme", "name": "ci"}, format="json")

    assert response.status_code == 201
    plaintext = response.json()["key"]
    assert KEY_RE.fullmatch(plaintext), plaintext
    _, prefix, secret = plaintext.split("-")
    row = ApiKey.objects.get(pk=response.json()["id"])
    assert (row.prefix, row.secret_hash) == (prefix, hash_key(plaintext))
    assert response.json()["prefix"] == prefix and response.json()["key_hint"] == f"tg-{prefix}-…"

    for again in (alice.get(f"/api/v1/keys/{row.pk}/"), alice.get("/api/v1/keys/")):
        assert again.status_code == 200
        assert "key" not in again.json() and plaintext not in again.content.decode()
        assert secret not in again.content.decode()
    # The creation is audited by prefix only.
    audit = AuditLog.objects.get(object_type="apikey", object_id=str(row.pk), action="create")
    assert audit.actor == world.alice and prefix in audit.object_repr
    _assert_nowhere([plaintext, secret], raw_logs)


def test_a_new_admin_token_is_shown_once_and_stored_as_prefix_and_hmac_only(
    world: World,
    client_for: Callable[..., APIClient],
    raw_logs: tuple[RawRecords, pytest.LogCaptureFixture],
) -> None:
    bob = client_for(world.bob)
    response = bob.post("/api/v1/tokens/", {"name": "laptop"}, format="json")

    assert response.status_code == 201
    plaintext = response.json()["token"]
    assert TOKEN_RE.fullmatch(plaintext), plaintext
    _, prefix, secret = plaintext.split("-")
    row = AdminToken.objects.get(pk=response.json()["id"])
    assert (row.user, row.prefix, row.secret_hash) == (world.bob, prefix, hash_key(plaintext))

    # It works, as bob, and is never shown again.
    new = APIClient()
    new.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    mine = new.get(f"/api/v1/tokens/{row.pk}/")
    assert mine.status_code == 200
    assert "token" not in mine.json() and secret not in mine.content.decode()
    assert secret not in new.get("/api/v1/tokens/").content.decode()
    assert new.get("/api/v1/users/").status_code == 403  # bob's rights, no more
    _assert_nowhere([plaintext, secret], raw_logs)


def test_the_log_configuration_shows_keys_by_prefix_only() -> None:
    """A key that does reach a log line comes out of the configured handler redacted."""
    console = next(
        h
        for h in logging.getLogger().handlers
        if any(isinstance(f, RedactSecretsFilter) for f in h.filters)
    )
    stream = io.StringIO()
    previous = console.setStream(stream)
    try:
        for kind in ("tg", "tga"):
            plaintext = f"{kind}-abcdefgh-{'Zz9' * 13}x"
            logging.getLogger("tollgate.test").warning("presented %s by mistake", plaintext)
            assert f"{kind}-abcdefgh-…" in stream.getvalue()
            assert plaintext not in stream.getvalue() and "Zz9Zz9" not in stream.getvalue()
    finally:
        console.setStream(previous)


# --- Who the admin API lets in ----------------------------------------------------------


def _bearer(value: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {value}")
    return client


def test_a_tenant_inference_key_is_not_an_admin_token(world: World) -> None:
    issued = services.issue_api_key(world.alice, world.tenant_a, name="inference")
    response = _bearer(issued.plaintext).get("/api/v1/keys/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_revoked_admin_token_is_refused(world: World) -> None:
    issued = services.issue_admin_token(world.alice, name="old")
    client = _bearer(issued.plaintext)
    assert client.get("/api/v1/keys/").status_code == 200
    assert client.post(f"/api/v1/tokens/{issued.token.pk}/revoke/").status_code == 200
    assert client.get("/api/v1/keys/").status_code == 401


def test_an_expired_admin_token_is_refused(world: World) -> None:
    issued = services.issue_admin_token(
        world.root, name="short", expires_at=timezone.now() + timedelta(hours=1)
    )
    client = _bearer(issued.plaintext)
    assert client.get("/api/v1/nodes/").status_code == 200
    with time_machine.travel(timezone.now() + timedelta(hours=1, seconds=1)):
        assert client.get("/api/v1/nodes/").status_code == 401


def test_a_deactivated_users_token_is_refused(world: World) -> None:
    issued = services.issue_admin_token(world.alice, name="t")
    world.alice.is_active = False
    world.alice.save(update_fields=["is_active"])
    assert _bearer(issued.plaintext).get("/api/v1/keys/").status_code == 401


ENDPOINTS = sorted(router_endpoints())


@pytest.mark.parametrize(("route", "method"), ENDPOINTS, ids=[" ".join(e) for e in ENDPOINTS])
def test_anonymous_requests_get_401_on_every_route(
    tenant_a: Tenant, alice: object, route: str, method: str
) -> None:
    """DRF answers 401 (with ``WWW-Authenticate: Bearer``) rather than 403, because the
    first authenticator names a scheme; never a 500, never data, never a write."""
    path = reverse(route, args=["acme"] if router_lookup_count(route) else [])
    before = db_state()
    response = APIClient().generic(method, path, data="{}", content_type="application/json")
    assert response.status_code == 401, response.content[:300]
    assert response["WWW-Authenticate"] == "Bearer"
    assert response["Content-Type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == 401 and problem["instance"] == path
    # Nothing but the path the caller asked for names the tenant.
    assert "acme" not in json.dumps({k: v for k, v in problem.items() if k != "instance"})
    assert db_state() == before


@pytest.mark.parametrize(
    "header",
    [
        "Bearer ",
        "Bearer tga-abcdefgh-" + "a" * 40,  # well-formed, unknown
        "Bearer garbage",
        "Basic YWxpY2U6cGFzc3dvcmQ=",
        "Token tga-abcdefgh-" + "a" * 40,
    ],
    ids=["empty bearer", "unknown token", "garbage", "basic auth", "other scheme"],
)
def test_bad_credentials_get_401(tenant_a: Tenant, alice: object, header: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    for path in ("/api/v1/tokens/", "/api/v1/audit/", "/api/v1/users/", "/api/v1/nodes/"):
        response = client.get(path)
        assert response.status_code == 401, (path, response.content)


def test_a_right_prefix_with_a_wrong_secret_is_refused(world: World) -> None:
    issued = services.issue_admin_token(world.root, name="t")
    kind, prefix, secret = issued.plaintext.split("-")
    forged = f"{kind}-{prefix}-{secret[::-1]}"
    assert _bearer(forged).get("/api/v1/nodes/").status_code == 401
    assert _bearer(issued.plaintext).get("/api/v1/nodes/").status_code == 200
