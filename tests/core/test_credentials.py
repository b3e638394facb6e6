"""The credentials rule (core.credentials): one header rule and one usable-key rule, and
the three places that apply it agree — ``ApiKey.objects.usable()``, the gateway's cached
``Gateway.authenticate`` and Django's ``/v1`` door (``tenants.auth.authenticate_api_key``)."""

from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.test import RequestFactory

from core.credentials import MAX_PRESENTED_KEY, presented_key, unexpired, unexpired_filter
from gateway.app import Gateway
from gateway.runtime import Runtime
from gateway.state import load_snapshot
from tenants import services
from tenants.auth import authenticate_api_key
from tenants.choices import TenantStatus
from tenants.models import ApiKey, Tenant

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("authorization", "api_key", "x_api_key", "presented"),
    [
        ("Bearer tg-abc", "", "", "tg-abc"),
        ("bearer   tg-abc  ", "", "", "tg-abc"),
        ("BEARER tg-abc", "tg-other", "tg-x", "tg-abc"),  # the Authorization header wins
        ("Basic dXNlcjpwYXNz", "tg-azure", "", "tg-azure"),  # Azure-style clients
        ("Bearer ", " tg-azure ", "", "tg-azure"),
        ("", "", " tg-anthropic ", "tg-anthropic"),  # Anthropic-style clients
        ("", "tg-azure", "tg-anthropic", "tg-azure"),
        ("Bearertg-abc", "", "", ""),
        ("", "", "", ""),
        ("Bearer " + "x" * 1000, "", "", "x" * MAX_PRESENTED_KEY),
        ("", "", "x" * 1000, "x" * MAX_PRESENTED_KEY),
    ],
)
def test_the_presented_key(
    authorization: str, api_key: str, x_api_key: str, presented: str
) -> None:
    assert presented_key(authorization, api_key, x_api_key) == presented


def test_unexpired_for_unix_seconds_and_datetimes() -> None:
    now = T0.timestamp()
    assert unexpired(0, now) and unexpired(now + 1, now)
    assert not unexpired(now, now) and not unexpired(now - 1, now)
    assert unexpired(None, T0) and unexpired(T0 + timedelta(microseconds=1), T0)
    assert not unexpired(T0, T0)


@pytest.mark.django_db
def test_unexpired_in_sql_agrees_with_unexpired(tenant_a: Tenant) -> None:
    expiries = [None, T0 - timedelta(seconds=1), T0, T0 + timedelta(seconds=1)]
    for i, expiry in enumerate(expiries):
        ApiKey.objects.create(
            tenant=tenant_a, name=f"k{i}", prefix=f"pfx{i:05d}", secret_hash="x", expires_at=expiry
        )
    in_sql = set(ApiKey.objects.filter(unexpired_filter(T0)).values_list("expires_at", flat=True))
    assert in_sql == {e for e in expiries if unexpired(e, T0)} == {None, T0 + timedelta(seconds=1)}


@pytest.fixture
def keys(tenant_a: Tenant, tenant_b: Tenant) -> dict[str, str]:
    """A key in every state the rule tells apart, by name -> plaintext (made at T0)."""
    with time_machine.travel(T0, tick=False):
        issue = services.issue_api_key
        out = {"live": issue(None, tenant_a, "live").plaintext}
        out["expires soon"] = issue(
            None, tenant_a, "soon", expires_at=T0 + timedelta(minutes=5)
        ).plaintext
        revoked = issue(None, tenant_a, "revoked")
        services.revoke_api_key(None, revoked.key)
        out["revoked"] = revoked.plaintext
        expired = issue(None, tenant_a, "expired", expires_at=T0 + timedelta(minutes=1))
        ApiKey.objects.filter(pk=expired.key.pk).update(expires_at=T0 - timedelta(minutes=1))
        out["expired"] = expired.plaintext
        parent = issue(None, tenant_a, "parent", expires_at=T0 + timedelta(minutes=5))
        out["child of a parent expiring soon"] = services.issue_child_key(
            parent.key, "child", T0 + timedelta(hours=1)
        ).plaintext
        gone = issue(None, tenant_a, "gone parent")
        out["child of a revoked parent"] = services.issue_child_key(
            gone.key, "child", T0 + timedelta(hours=1)
        ).plaintext
        services.revoke_api_key(None, gone.key)
        out["suspended tenant"] = issue(None, tenant_b, "b").plaintext
        services.set_tenant_status(None, tenant_b, TenantStatus.SUSPENDED)
    return out


def _gateway_accepts(gateway: Gateway, plaintext: str) -> bool:
    return (
        gateway.authenticate({"headers": [(b"authorization", f"Bearer {plaintext}".encode())]})
        is not None
    )


def _django_accepts(plaintext: str) -> bool:
    request = RequestFactory().get("/v1/usage", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return authenticate_api_key(request) is not None


def _orm_accepts(plaintext: str) -> bool:
    return ApiKey.objects.usable().filter(prefix=plaintext.split("-")[1]).exists()


@pytest.mark.django_db
def test_the_gateway_the_django_door_and_the_orm_agree_as_time_passes(keys: dict[str, str]) -> None:
    """The gateway's snapshot is loaded once, at T0; the other two read the database at each
    moment. Ten minutes on, the keys that expire (their own expiry or their parent's) have
    left all three."""
    gateway = Gateway(Runtime())
    with time_machine.travel(T0, tick=False):
        gateway.rt.snapshot = load_snapshot()
    usable_at = {
        T0 + timedelta(seconds=1): {"live", "expires soon", "child of a parent expiring soon"},
        T0 + timedelta(minutes=10): {"live"},
    }
    for moment, usable in usable_at.items():
        with time_machine.travel(moment, tick=False):
            for name, plaintext in keys.items():
                verdicts = (
                    _orm_accepts(plaintext),
                    _gateway_accepts(gateway, plaintext),
                    _django_accepts(plaintext),
                )
                assert verdicts == ((name in usable),) * 3, (moment, name, verdicts)


@pytest.mark.django_db
def test_both_doors_take_the_key_from_x_api_key(keys: dict[str, str]) -> None:
    """Anthropic-style clients send ``x-api-key``: the gateway and Django's door accept a
    usable key there and refuse a revoked one, as with ``Authorization: Bearer``."""
    gateway = Gateway(Runtime())
    with time_machine.travel(T0 + timedelta(seconds=1), tick=False):
        gateway.rt.snapshot = load_snapshot()
        for name, usable in (("live", True), ("revoked", False)):
            presented = keys[name]
            scope = {"headers": [(b"x-api-key", presented.encode())]}
            request = RequestFactory().get("/v1/usage", HTTP_X_API_KEY=presented)
            assert (gateway.authenticate(scope) is not None) is usable
            assert (authenticate_api_key(request) is not None) is usable
