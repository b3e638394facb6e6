"""State-changing actions: their effect is visible through the API, they are audited with
the actor, and repeating one is harmless (200, nothing changes, no second audit row)."""

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from tenants.models import AuditLog
from tests.api.conftest import World

# (who acts, first action path, field, value after it, audit action, object type,
#  the opposite action path and its value, or None)
ACTIONS = [
    (
        "root",
        lambda w: "/api/v1/tenants/acme/suspend/",
        "status",
        "suspended",
        "suspend",
        "tenant",
        lambda w: "/api/v1/tenants/acme/activate/",
        "active",
        "activate",
    ),
    (
        "root",
        lambda w: "/api/v1/deployments/qwen-main/stop/",
        "desired_state",
        "stopped",
        "action",
        "deployment",
        lambda w: "/api/v1/deployments/qwen-main/start/",
        "running",
        "action",
    ),
]


def _audit_rows(object_type: str, action: str) -> list[AuditLog]:
    return list(AuditLog.objects.filter(object_type=object_type, action=action).order_by("id"))


@pytest.mark.parametrize(
    (
        "who",
        "path",
        "field",
        "value",
        "audit_action",
        "object_type",
        "back",
        "back_value",
        "back_action",
    ),
    ACTIONS,
    ids=["tenant suspend/activate", "deployment stop/start"],
)
def test_actions_show_their_effect_are_audited_and_repeat_harmlessly(
    who: str,
    path: Callable[[World], str],
    field: str,
    value: str,
    audit_action: str,
    object_type: str,
    back: Callable[[World], str],
    back_value: str,
    back_action: str,
    world: World,
    client_for: Callable[..., APIClient],
) -> None:
    client = client_for(getattr(world, who))
    detail = path(world).rsplit("/", 2)[0] + "/"
    before = len(_audit_rows(object_type, audit_action))

    first = client.post(path(world))
    assert first.status_code == 200 and first.json()[field] == value
    assert client.get(detail).json()[field] == value
    rows = _audit_rows(object_type, audit_action)
    assert len(rows) == before + 1
    assert rows[-1].actor == getattr(world, who) and rows[-1].actor_label == who

    again = client.post(path(world))
    assert again.status_code == 200 and again.json()[field] == value
    assert len(_audit_rows(object_type, audit_action)) == before + 1

    returned = client.post(back(world))
    assert returned.status_code == 200 and returned.json()[field] == back_value
    assert client.get(detail).json()[field] == back_value
    assert _audit_rows(object_type, back_action)[-1].actor == getattr(world, who)


def test_suspending_a_tenant_is_visible_to_its_own_users_and_in_its_audit_log(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    assert client_for(world.root).post("/api/v1/tenants/acme/suspend/").status_code == 200
    assert client_for(world.bob).get("/api/v1/tenants/acme/").json()["status"] == "suspended"
    entries = client_for(world.alice).get("/api/v1/audit/", {"action": "suspend"}).json()
    assert [(e["tenant"], e["actor_label"], e["object_type"]) for e in entries["results"]] == [
        ("acme", "root", "tenant")
    ]
    # Tenant B is untouched and its admin does not see tenant A's entry.
    assert client_for(world.carol).get("/api/v1/tenants/bravo/").json()["status"] == "active"
    assert client_for(world.carol).get("/api/v1/audit/", {"action": "suspend"}).json()["count"] == 0


@pytest.mark.parametrize("who", ["alice", "root"])
def test_revoking_a_key_twice_is_harmless_and_audited_once(
    who: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(getattr(world, who))
    path = f"/api/v1/keys/{world.alice_key.pk}/"

    first = client.post(path + "revoke/")
    assert first.status_code == 200
    assert first.json()["status"] == "revoked" and first.json()["revoked_at"]
    again = client.post(path + "revoke/")
    assert again.status_code == 200
    assert again.json()["revoked_at"] == first.json()["revoked_at"]
    assert client.get(path).json()["status"] == "revoked"
    revokes = AuditLog.objects.filter(
        object_type="apikey", object_id=str(world.alice_key.pk), action="revoke"
    )
    assert [(r.actor, r.tenant) for r in revokes] == [(getattr(world, who), world.tenant_a)]
    # Revoked keys can be listed apart.
    revoked = client.get("/api/v1/keys/", {"revoked_at__isnull": "false"}).json()["results"]
    assert [k["prefix"] for k in revoked] == [world.alice_key.prefix]


def test_revoking_an_admin_token_twice_is_harmless_and_audited_once(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(world.alice)
    path = f"/api/v1/tokens/{world.alice_token.pk}/"
    first = client.post(path + "revoke/")
    again = client.post(path + "revoke/")
    assert first.status_code == again.status_code == 200
    assert first.json()["revoked_at"] and again.json()["revoked_at"] == first.json()["revoked_at"]
    assert client.get(path).json()["revoked_at"] == first.json()["revoked_at"]
    revokes = AuditLog.objects.filter(
        object_type="admintoken", object_id=str(world.alice_token.pk), action="revoke"
    )
    assert [r.actor for r in revokes] == [world.alice]


def test_granting_and_ungranting_a_private_model_changes_what_tenant_b_sees(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root, carol = client_for(world.root), client_for(world.carol)
    path = f"/api/v1/models/{world.private_model_a.pk}/"
    assert carol.get(path).status_code == 404

    assert root.post(path + "grant/", {"tenant": "bravo"}, format="json").status_code == 201
    assert carol.get(path).status_code == 200
    assert sorted(root.get(path).json()["granted_tenants"]) == ["acme", "bravo"]
    audit = AuditLog.objects.get(
        action="grant", object_repr="acme-secret-70b", tenant=world.tenant_b
    )
    assert audit.actor == world.root

    assert root.post(path + "ungrant/", {"tenant": "bravo"}, format="json").status_code == 200
    assert carol.get(path).status_code == 404
    assert root.get(path).json()["granted_tenants"] == ["acme"]
    assert (
        AuditLog.objects.filter(action="ungrant", tenant=world.tenant_b).get().actor == world.root
    )
    # Ungranting what is not granted is "not found".
    assert root.post(path + "ungrant/", {"tenant": "bravo"}, format="json").status_code == 404


def test_grant_and_ungrant_answer_with_the_models_new_grants(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """The action's response is the model after the change, as a later GET shows it."""
    root = client_for(world.root)
    path = f"/api/v1/models/{world.private_model_a.pk}/"
    granted = root.post(path + "grant/", {"tenant": "bravo"}, format="json")
    assert sorted(granted.json()["granted_tenants"]) == ["acme", "bravo"]
    ungranted = root.post(path + "ungrant/", {"tenant": "bravo"}, format="json")
    assert ungranted.json()["granted_tenants"] == ["acme"]


def test_members_and_keys_changed_by_the_tenant_admin_are_audited_with_the_actor(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    alice = client_for(world.alice)
    added = alice.post(
        "/api/v1/members/", {"tenant": "acme", "user": "dave", "role": "member"}, format="json"
    )
    assert added.status_code == 201
    promoted = alice.patch(
        f"/api/v1/members/{added.json()['id']}/", {"role": "admin"}, format="json"
    )
    assert promoted.status_code == 200 and promoted.json()["role"] == "admin"
    # With a second admin, alice may step down.
    stepped = alice.patch(
        f"/api/v1/members/{world.alice_membership.pk}/", {"role": "member"}, format="json"
    )
    assert stepped.status_code == 200
    renamed = client_for(world.dave).patch(
        f"/api/v1/keys/{world.alice_key.pk}/", {"name": "renamed"}, format="json"
    )
    assert renamed.status_code == 200 and renamed.json()["name"] == "renamed"

    entries = client_for(world.dave).get("/api/v1/audit/", {"limit": 100}).json()["results"]
    summary = [(e["actor_label"], e["action"], e["object_type"]) for e in entries]
    assert ("alice", "create", "membership") in summary
    assert ("alice", "update", "membership") in summary
    assert ("dave", "update", "apikey") in summary
    key_update = next(
        e for e in entries if e["object_type"] == "apikey" and e["action"] == "update"
    )
    assert key_update["changes"] == {"name": ["acme-prod", "renamed"]}


def test_removing_a_member_takes_away_their_view_of_the_tenant(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    bob = client_for(world.bob)
    assert bob.get("/api/v1/tenants/acme/").status_code == 200
    removed = client_for(world.alice).delete(f"/api/v1/members/{world.bob_membership.pk}/")
    assert removed.status_code == 204
    assert bob.get("/api/v1/tenants/acme/").status_code == 404
    assert bob.get(f"/api/v1/keys/{world.bob_key.pk}/").status_code == 404
    assert (
        AuditLog.objects.filter(action="delete", object_type="membership").get().actor
        == world.alice
    )


def test_lowering_a_tenant_limit_through_the_api_tightens_its_keys(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root = client_for(world.root)
    response = root.patch("/api/v1/tenants/acme/", {"requests_per_minute": 50}, format="json")
    assert response.status_code == 200 and response.json()["requests_per_minute"] == 50
    key: Any = client_for(world.alice).get(f"/api/v1/keys/{world.alice_key.pk}/").json()
    assert key["requests_per_minute"] == 50
    # Tenant B's keys are not touched by tenant A's change.
    assert (
        client_for(world.carol).get("/api/v1/tenants/bravo/").json()["requests_per_minute"] == 600
    )
