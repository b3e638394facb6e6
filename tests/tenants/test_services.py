"""The rules of tenants/services.py (tenants, members, keys, boosts), against PostgreSQL and
Redis."""

from datetime import timedelta

import orjson
import pytest
import time_machine
from django.core.exceptions import ValidationError
from django.utils import timezone

from core.keyspace import invalidation_channel
from core.redis import get_redis
from deployments.models import CatalogModel
from tenants import services
from tenants.choices import Role, TenantStatus
from tenants.keys import verify_key
from tenants.models import ApiKey, AuditLog, Tenant

pytestmark = pytest.mark.django_db


def test_new_tenant_gets_defaults_and_a_unique_slug() -> None:
    first = services.create_tenant(None, name="Acme Research")
    second = services.create_tenant(None, name="Acme Research")
    assert (first.slug, second.slug) == ("acme-research", "acme-research-2")
    assert first.priority == "P1" and first.quota_period == "monthly" and first.currency == "USD"
    assert first.requests_per_minute == 600 and first.is_active


def test_issued_key_verifies_and_only_its_hash_is_stored(tenant_a: Tenant, alice: object) -> None:
    issued = services.issue_api_key(alice, tenant_a, name="ci")
    stored = ApiKey.objects.get(pk=issued.key.pk)
    assert verify_key(issued.plaintext, stored.secret_hash)
    assert issued.plaintext.split("-")[2] not in stored.secret_hash
    assert stored.created_by == alice
    audit = AuditLog.objects.get(object_type="apikey", action="create")
    assert issued.plaintext not in orjson.dumps(audit.changes).decode() + audit.object_repr
    assert f"tg-{stored.prefix}-" in audit.object_repr


def test_key_limits_can_only_be_tighter_than_the_tenant(tenant_a: Tenant) -> None:
    with pytest.raises(ValidationError) as error:
        services.issue_api_key(None, tenant_a, name="greedy", requests_per_minute=601)
    assert "requests_per_minute" in error.value.message_dict
    key = services.issue_api_key(None, tenant_a, name="modest", requests_per_minute=60).key
    assert key.requests_per_minute == 60


def test_lowering_a_tenant_limit_tightens_its_keys(tenant_a: Tenant) -> None:
    key = services.issue_api_key(None, tenant_a, name="k", tokens_per_minute=500_000).key
    services.update_tenant(None, tenant_a, tokens_per_minute=100_000)
    key.refresh_from_db()
    assert key.tokens_per_minute == 100_000


def test_key_expiry_must_be_in_the_future(tenant_a: Tenant) -> None:
    with pytest.raises(ValidationError, match="future"):
        services.issue_api_key(
            None, tenant_a, name="old", expires_at=timezone.now() - timedelta(seconds=1)
        )


def test_usable_keys_exclude_revoked_expired_and_suspended(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    live = services.issue_api_key(None, tenant_a, name="live").key
    revoked = services.revoke_api_key(None, services.issue_api_key(None, tenant_a, name="gone").key)
    expiring = services.issue_api_key(
        None, tenant_a, name="soon", expires_at=timezone.now() + timedelta(hours=1)
    ).key
    suspended = services.issue_api_key(None, tenant_b, name="b").key
    services.set_tenant_status(None, tenant_b, TenantStatus.SUSPENDED)
    assert set(ApiKey.objects.usable()) == {live, expiring}
    with time_machine.travel(timezone.now() + timedelta(hours=2)):
        assert set(ApiKey.objects.usable()) == {live}
    assert revoked.status == "revoked" and suspended not in ApiKey.objects.usable()


def test_revoking_twice_keeps_the_first_time_and_one_audit_row(tenant_a: Tenant) -> None:
    key = services.issue_api_key(None, tenant_a, name="k").key
    first = services.revoke_api_key(None, key).revoked_at
    again = services.revoke_api_key(None, key).revoked_at
    assert first is not None and again == first
    assert AuditLog.objects.filter(action="revoke", object_id=str(key.pk)).count() == 1


def test_a_tenant_keeps_at_least_one_admin(tenant_a: Tenant, alice: object, bob: object) -> None:
    admin = alice.memberships.get()
    with pytest.raises(ValidationError, match="at least one tenant admin"):
        services.change_role(None, admin, Role.MEMBER)
    with pytest.raises(ValidationError, match="at least one tenant admin"):
        services.remove_member(None, admin)
    services.change_role(None, bob.memberships.get(), Role.ADMIN)
    services.change_role(None, admin, Role.MEMBER)
    assert admin.role == Role.MEMBER


def next_message(pubsub: object, timeout: float = 2.0) -> dict | None:
    """The next published message; subscribe confirmations are skipped."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=deadline - time.monotonic())
        if message is not None:
            return message
    return None


def test_changes_are_announced_to_gateways_after_commit(
    tenant_a: Tenant, django_capture_on_commit_callbacks: object
) -> None:
    pubsub = get_redis().pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(invalidation_channel())
    try:
        with django_capture_on_commit_callbacks(execute=True):
            services.set_tenant_status(None, tenant_a, TenantStatus.SUSPENDED)
        message = next_message(pubsub)
    finally:
        pubsub.close()
    assert message is not None
    assert orjson.loads(message["data"]) == {"kind": "tenant", "id": str(tenant_a.pk)}


def test_an_interactive_boost_lasts_its_window_then_falls_back(tenant_a: Tenant) -> None:
    services.grant_interactive(None, tenant_a, 30)
    assert tenant_a.effective_priority == "P0"
    with time_machine.travel(timezone.now() + timedelta(minutes=31)):
        assert tenant_a.effective_priority == "P1"
    with pytest.raises(ValidationError, match="minutes"):
        services.grant_interactive(None, tenant_a, 10_000)
    services.grant_interactive(None, tenant_a, 0)
    tenant_a.refresh_from_db()
    assert tenant_a.priority_boost_until is None and tenant_a.effective_priority == "P1"


def test_child_keys_act_for_their_parent_and_die_with_it(
    tenant_a: Tenant, public_model: CatalogModel
) -> None:
    from gateway.state import load_snapshot

    parent = services.issue_api_key(
        None, tenant_a, name="p", requests_per_minute=30, allowed_models=[public_model]
    ).key
    child = services.issue_child_key(parent, "batch 1", timezone.now() + timedelta(hours=1))
    info = load_snapshot().keys[child.key.prefix]
    assert info.id == parent.pk and info.limits.rpm == 30 and info.model_ids == {public_model.pk}
    services.revoke_api_key(None, parent)
    assert child.key.prefix not in load_snapshot().keys
