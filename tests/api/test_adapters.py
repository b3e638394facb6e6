"""LoRA adapters on the admin API, by role: platform admins manage every adapter, a tenant's
admins their tenant's (never sharing one beyond it), members read what their tenant may call,
and tenant B finds nothing of tenant A's (every route and method of it: test_isolation.py).
Every change is in the audit log with its actor."""

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from core.keyspace import lora_keys
from core.redis import get_redis
from deployments import adapters as adapter_services
from deployments import services as deployment_services
from deployments.choices import AdapterStatus, ReplicaState
from deployments.models import Adapter, Replica
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import AuditLog
from tests.api.conftest import World, db_state

LIST = "/api/v1/adapters/"
SUPPORT = "/api/v1/adapters/acme/support-v3/"  # tenant A's private adapter (world.adapter_a)
# Whom it is shared with and where engines hold it: platform admins only.
STAFF_ONLY = {"granted_tenants", "loaded_on"}
# Whose it is and where its files are: not for a tenant it was merely shared with.
OWNER_ONLY = {"tenant", "source", "status_message", "pinned"}
# A tenant's adapters are named under its slug; the answer to any other name.
ACME_SPACE = "Name Acme Research's adapters acme/<name>, e.g. acme/support-v3."


def body(**fields: Any) -> dict[str, Any]:
    return {
        "served_name": "acme/legal-v1",
        "base": "qwen3-8b",
        "source": "acme/legal-v1-lora",
        **fields,
    }


def names(response: Any) -> list[str]:
    assert response.status_code == 200, response.content[:300]
    return [row["served_name"] for row in response.json()["results"]]


def errors(response: Any) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


def audit(action: str, served_name: str) -> list[AuditLog]:
    rows = AuditLog.objects.filter(object_type="adapter", action=action, object_repr=served_name)
    return list(rows.order_by("id"))


@pytest.fixture
def platform_adapter(world: World) -> Adapter:
    """The platform's own public adapter: every tenant that may call its base may call it."""
    return adapter_services.create_adapter(
        world.root,
        served_name="platform/concise",
        base=world.public_model,
        tenant=None,
        visibility="public",
        source="tollgate/concise-lora",
    )


@pytest.fixture
def adapter_b(world: World) -> Adapter:
    """Tenant B's private adapter."""
    return adapter_services.create_adapter(
        world.carol,
        served_name="bravo/triage",
        base=world.public_model,
        tenant=world.tenant_b,
        source="bravo/triage-lora",
    )


# --- Tenant admins -------------------------------------------------------------------------


def test_a_tenant_admin_registers_an_adapter_for_their_tenant_and_only_it_sees_it(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    alice = client_for(world.alice)
    created = alice.post(LIST, body(description="Contracts."), format="json")
    assert created.status_code == 201, created.content
    adapter = created.json()
    assert (adapter["tenant"], adapter["visibility"], adapter["status"]) == (
        "acme",
        "private",
        "checking",
    )
    # No deployment of the base serves adapters yet: the check waits, and says why.
    assert "enable-lora" in adapter["status_message"]
    assert [(a.actor, a.tenant) for a in audit("create", "acme/legal-v1")] == [
        (world.alice, world.tenant_a)
    ]

    assert "acme/legal-v1" in names(alice.get(LIST))
    assert "acme/legal-v1" in names(client_for(world.bob).get(LIST))
    carol = client_for(world.carol)
    assert "acme/legal-v1" not in names(carol.get(LIST))
    assert carol.get("/api/v1/adapters/acme/legal-v1/").status_code == 404
    assert carol.get(f"/api/v1/adapters/{adapter['id']}/").status_code == 404


def test_a_tenant_admin_changes_and_deletes_their_tenants_adapter(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    alice = client_for(world.alice)
    changed = alice.patch(
        SUPPORT,
        {"description": "Warmer.", "source": "/root/.cache/huggingface/acme/support-v3b"},
        format="json",
    )
    assert changed.status_code == 200, changed.content
    assert changed.json()["source"] == "/root/.cache/huggingface/acme/support-v3b"
    assert changed.json()["status"] == "checking"  # new files are checked again
    [update] = audit("update", "acme/support-v3")
    assert update.actor == world.alice and update.tenant == world.tenant_a
    assert update.changes["description"] == ["Acme's support tone.", "Warmer."]
    assert set(update.changes) == {"description", "source"}

    assert alice.delete(SUPPORT).status_code == 204
    assert alice.get(SUPPORT).status_code == 404
    assert not Adapter.objects.filter(served_name="acme/support-v3").exists()
    assert [a.actor for a in audit("delete", "acme/support-v3")] == [world.alice]


def test_a_tenant_admin_of_two_tenants_says_which_owns_a_new_adapter(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    tenant_services.add_member(None, world.tenant_b, world.alice, Role.ADMIN)
    alice = client_for(world.alice)
    unsaid = alice.post(LIST, body(), format="json")
    assert unsaid.status_code == 400 and "tenant" in errors(unsaid)
    said = alice.post(LIST, body(tenant="bravo", served_name="bravo/legal"), format="json")
    assert said.status_code == 201 and said.json()["tenant"] == "bravo"


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        (None, "only platform admins register adapters of no tenant"),
        ("bravo", "does not exist"),
        ("nope", "does not exist"),
    ],
    ids=["no tenant", "another tenant", "unknown tenant"],
)
def test_a_tenant_admins_adapter_is_always_their_tenants(
    tenant: str | None, message: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    alice = client_for(world.alice)
    before = db_state()
    answer = alice.post(LIST, body(tenant=tenant), format="json")
    assert answer.status_code == 400
    assert message in errors(answer)["tenant"]
    moved = alice.patch(SUPPORT, {"tenant": tenant}, format="json")
    assert moved.status_code == 400 and message in errors(moved)["tenant"]
    assert db_state() == before


@pytest.mark.parametrize(
    "served_name",
    ["legal-v1", "acme-legal", "acmelegal/v1", "bravo/legal", "platform/legal"],
)
def test_a_tenant_admin_names_her_adapters_under_her_tenants_slug(
    served_name: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    alice = client_for(world.alice)
    before = db_state()
    answer = alice.post(LIST, body(served_name=served_name), format="json")
    assert answer.status_code == 400, answer.content[:300]
    assert errors(answer) == {"served_name": ACME_SPACE}
    renamed = alice.patch(SUPPORT, {"served_name": served_name}, format="json")
    assert renamed.status_code == 400 and errors(renamed) == {"served_name": ACME_SPACE}
    assert db_state() == before


def test_a_name_in_another_tenants_space_says_nothing_of_its_adapters(
    world: World, client_for: Callable[..., APIClient], adapter_b: Adapter
) -> None:
    """bravo/triage exists, bravo/nothing does not: tenant A's admin gets the same answer
    for both, on a new adapter and on a rename (never the 409 of a taken name)."""
    alice = client_for(world.alice)
    before = db_state()
    answers = {}
    for name in ["bravo/triage", "bravo/nothing"]:
        made = alice.post(LIST, body(served_name=name), format="json")
        renamed = alice.patch(SUPPORT, {"served_name": name}, format="json")
        assert made.status_code == renamed.status_code == 400, made.content[:300]
        assert errors(made) == errors(renamed) == {"served_name": ACME_SPACE}
        answers[name] = (made.content, renamed.content)
    assert answers["bravo/triage"] == answers["bravo/nothing"]
    assert db_state() == before
    # A platform admin may name a platform adapter anything not taken, and is told so.
    root = client_for(world.root)
    taken = root.post(LIST, body(served_name="bravo/triage", tenant=None), format="json")
    assert taken.status_code == 409 and "already exists" in errors(taken)["served_name"]
    free = root.post(LIST, body(served_name="bravo/nothing", tenant=None), format="json")
    assert free.status_code == 201 and free.json()["tenant"] is None


# --- Sharing and pinning are a platform admin's choice ---------------------------------------


def _refused_by_role(answer: Any, reason: str = adapter_services.NOT_YOURS_TO_SHARE) -> None:
    """403, naming why (the existing API answers admin-only actions with 403)."""
    assert answer.status_code == 403, answer.content[:300]
    assert answer.json()["detail"] == reason


def test_a_tenant_admin_may_not_make_an_adapter_public_nor_grant_it(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    alice = client_for(world.alice)
    before = db_state()
    _refused_by_role(alice.post(LIST, body(visibility="public"), format="json"))
    _refused_by_role(alice.patch(SUPPORT, {"visibility": "public"}, format="json"))
    _refused_by_role(alice.post(SUPPORT + "grant/", {"tenant": "bravo"}, format="json"))
    _refused_by_role(alice.post(SUPPORT + "ungrant/", {"tenant": "acme"}, format="json"))
    assert db_state() == before
    assert "acme/support-v3" not in names(client_for(world.carol).get(LIST))


def test_a_tenant_admin_may_keep_editing_an_adapter_an_admin_made_public_or_unshare_it(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root, alice = client_for(world.root), client_for(world.alice)
    assert root.patch(SUPPORT, {"visibility": "public"}, format="json").status_code == 200
    assert "acme/support-v3" in names(client_for(world.carol).get(LIST))
    unchanged = alice.patch(SUPPORT, {"visibility": "public", "description": "x"}, format="json")
    assert unchanged.status_code == 200
    private = alice.patch(SUPPORT, {"visibility": "private"}, format="json")
    assert private.status_code == 200 and private.json()["visibility"] == "private"
    assert "acme/support-v3" not in names(client_for(world.carol).get(LIST))


def test_only_a_platform_admin_pins_an_adapter(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """A pinned adapter holds an engine slot on every replica of a base all tenants share."""
    alice = client_for(world.alice)
    before = db_state()
    pinned = adapter_services.NOT_YOURS_TO_PIN
    _refused_by_role(alice.post(LIST, body(pinned=True), format="json"), pinned)
    _refused_by_role(alice.patch(SUPPORT, {"pinned": True}, format="json"), pinned)
    assert db_state() == before

    root = client_for(world.root)
    made = root.patch(SUPPORT, {"pinned": True}, format="json")
    assert made.status_code == 200 and made.json()["pinned"] is True
    [update] = audit("update", "acme/support-v3")
    assert (update.actor, update.changes["pinned"]) == (world.root, [False, True])
    # Its tenant's admin may keep editing it pinned, or unpin it (which frees the slots).
    kept = alice.patch(SUPPORT, {"pinned": True, "description": "Kept."}, format="json")
    assert kept.status_code == 200 and kept.json()["pinned"] is True
    unpinned = alice.patch(SUPPORT, {"pinned": False}, format="json")
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False
    _refused_by_role(alice.patch(SUPPORT, {"pinned": True}, format="json"), pinned)


def test_granting_an_adapter_lets_tenant_b_call_it_without_learning_whose_it_is(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root, carol = client_for(world.root), client_for(world.carol)
    granted = root.post(SUPPORT + "grant/", {"tenant": "bravo"}, format="json")
    assert granted.status_code == 201 and granted.json()["granted_tenants"] == ["bravo"]
    [grant] = audit("grant", "acme/support-v3")
    assert (grant.actor, grant.tenant, grant.changes) == (
        world.root,
        world.tenant_b,
        {"tenant": "bravo"},
    )

    shown = carol.get(SUPPORT)
    assert shown.status_code == 200
    assert not (STAFF_ONLY | OWNER_ONLY) & set(shown.json())
    assert "acme" not in json.dumps({k: v for k, v in shown.json().items() if k != "served_name"})
    assert carol.get(LIST, {"tenant__slug": "acme"}).json()["count"] == 0
    assert root.get(LIST, {"tenant__slug": "acme"}).json()["count"] == 1
    # She may call it, not change it: now that she sees it, the refusal is a 403.
    refused = carol.patch(SUPPORT, {"description": "mine"}, format="json")
    assert refused.status_code == 403
    assert carol.post(SUPPORT + "check/").status_code == 403
    assert carol.delete(SUPPORT).status_code == 403

    ungranted = root.post(SUPPORT + "ungrant/", {"tenant": "bravo"}, format="json")
    assert ungranted.status_code == 200 and ungranted.json()["granted_tenants"] == []
    assert [u.actor for u in audit("ungrant", "acme/support-v3")] == [world.root]
    assert carol.get(SUPPORT).status_code == 404
    assert root.post(SUPPORT + "ungrant/", {"tenant": "bravo"}, format="json").status_code == 404


# --- Members -----------------------------------------------------------------------------


def test_a_member_reads_the_adapters_his_tenant_may_call(
    world: World,
    client_for: Callable[..., APIClient],
    platform_adapter: Adapter,
    adapter_b: Adapter,
) -> None:
    bob = client_for(world.bob)
    assert names(bob.get(LIST)) == ["acme/support-v3", "platform/concise"]
    own = bob.get(SUPPORT).json()
    assert (own["tenant"], own["source"]) == ("acme", "acme/support-v3-lora")
    assert not STAFF_ONLY & set(own)
    shared = bob.get("/api/v1/adapters/platform/concise/").json()
    assert not (STAFF_ONLY | OWNER_ONLY) & set(shared)
    assert bob.get("/api/v1/adapters/bravo/triage/").status_code == 404
    refused = bob.post(LIST, body(), format="json")
    assert refused.status_code == 403
    assert refused.json()["detail"] == "Only tenant admins can register adapters."


def test_an_adapter_leaves_a_members_list_when_his_tenant_may_no_longer_call_its_base(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """…but stays in his tenant admin's, who can still change or delete it."""
    root = client_for(world.root)
    answer = root.patch("/api/v1/models/qwen3-8b/", {"visibility": "private"}, format="json")
    assert answer.status_code == 200
    assert names(client_for(world.bob).get(LIST)) == []
    assert names(client_for(world.alice).get(LIST)) == ["acme/support-v3"]
    assert client_for(world.alice).delete(SUPPORT).status_code == 204


# --- Platform admins ------------------------------------------------------------------------


def test_a_platform_admin_manages_every_adapter(
    world: World, client_for: Callable[..., APIClient], adapter_b: Adapter
) -> None:
    root = client_for(world.root)
    assert names(root.get(LIST)) == ["acme/support-v3", "bravo/triage"]
    made = root.post(
        LIST,
        body(served_name="platform/short", tenant=None, visibility="public", pinned=True),
        format="json",
    )
    assert made.status_code == 201, made.content
    assert (made.json()["tenant"], made.json()["pinned"]) == (None, True)
    assert set(made.json()) >= STAFF_ONLY | OWNER_ONLY
    assert [(a.actor, a.tenant) for a in audit("create", "platform/short")] == [(world.root, None)]
    for user in (world.alice, world.bob, world.carol):
        assert "platform/short" in names(client_for(user).get(LIST))

    # Another tenant's adapter is named in its space: moving one renames it there.
    triage = "/api/v1/adapters/bravo/triage/"
    unnamed = root.patch(triage, {"tenant": "acme"}, format="json")
    assert unnamed.status_code == 400 and errors(unnamed)["served_name"] == ACME_SPACE
    moved = root.patch(triage, {"tenant": "acme", "served_name": "acme/triage"}, format="json")
    assert moved.status_code == 200 and moved.json()["tenant"] == "acme"
    assert "acme/triage" in names(client_for(world.alice).get(LIST))
    assert root.delete(f"/api/v1/adapters/{world.adapter_a.pk}/").status_code == 204
    assert [a.actor for a in audit("delete", "acme/support-v3")] == [world.root]


def test_a_platform_admin_sees_which_replicas_hold_an_adapter(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """The worker's record in Redis, as the gateway routes by it; only ready replicas count."""
    replica = Replica.objects.get(deployment=world.deployment, index=0)
    adapter = world.adapter_a
    get_redis().hset(lora_keys(replica.pk)[0], adapter.pk, adapter.served_name)
    root = client_for(world.root)
    assert root.get(SUPPORT).json()["loaded_on"] == []  # the replica is not ready

    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.READY)
    held = [{"deployment": "qwen-main", "replica": 0, "node": "spark-1"}]
    assert root.get(SUPPORT).json()["loaded_on"] == held
    rows = {a["served_name"]: a["loaded_on"] for a in root.get(LIST).json()["results"]}
    assert rows == {"acme/support-v3": held}
    assert "loaded_on" not in client_for(world.alice).get(SUPPORT).json()


# --- Bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "status", "field", "message"),
    [
        ({"served_name": "acme/support-v3"}, 409, "served_name", "already exists"),
        ({"served_name": "-bad name"}, 400, "served_name", "Use letters, digits"),
        ({"base": "no-such-model"}, 400, "base", "does not exist"),
        ({"source": "not a repo"}, 400, "source", "Hugging Face repo id"),
        ({"source": "/root/.cache/huggingface/../../etc"}, 400, "source", "absolute path"),
        ({"source": "/etc/lora"}, 400, "source", "inside the cache"),
        ({"priority": "P0"}, 400, "priority", "Unknown field"),
        ({"status": "ready"}, 400, "status", "read-only"),
    ],
    ids=[
        "a taken name",
        "a bad name",
        "unknown base",
        "not a source",
        "path escaping the cache",
        "path outside the cache",
        "unknown field",
        "read-only field",
    ],
)
def test_bad_input_is_refused_naming_the_field(
    fields: dict[str, Any],
    status: int,
    field: str,
    message: str,
    world: World,
    client_for: Callable[..., APIClient],
) -> None:
    for client in (client_for(world.root), client_for(world.alice)):
        before = db_state()
        answer = client.post(LIST, body(**fields), format="json")
        assert answer.status_code == status, answer.content[:300]
        assert message in errors(answer)[field]
        assert db_state() == before


def test_no_adapter_takes_a_models_name(world: World, client_for: Callable[..., APIClient]) -> None:
    """Not the platform's (which may have any other name), nor a tenant's, even when a model
    was named in the tenant's space."""
    deployment_services.create_model(
        None,
        served_name="acme/tuned-8b",
        source="org/tuned-8b",
        params_billions=Decimal("8"),
        context_length=8192,
    )
    root, alice = client_for(world.root), client_for(world.alice)
    before = db_state()
    answers = [
        root.post(LIST, body(served_name="qwen3-8b"), format="json"),
        root.patch(SUPPORT, {"served_name": "acme/tuned-8b"}, format="json"),
        alice.post(LIST, body(served_name="acme/tuned-8b"), format="json"),
        alice.patch(SUPPORT, {"served_name": "acme/tuned-8b"}, format="json"),
    ]
    for answer, name in zip(answers, ["qwen3-8b", *["acme/tuned-8b"] * 3], strict=True):
        assert answer.status_code == 409, answer.content[:300]
        assert errors(answer) == {"served_name": f"A model is already called {name!r}."}
    assert db_state() == before


def test_a_base_tenant_b_may_not_call_reads_like_an_unknown_one(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    carol = client_for(world.carol)
    answers = {}
    for base in ["acme-secret-70b", "no-such-model"]:
        answer = carol.post(LIST, body(served_name="bravo/x", base=base), format="json")
        assert answer.status_code == 400
        answers[base] = answer.content.decode().replace(base, "<base>")
    assert answers["acme-secret-70b"] == answers["no-such-model"]
    # A platform admin is told plainly.
    root = client_for(world.root)
    wrong = root.post(LIST, body(tenant="bravo", base="acme-secret-70b"), format="json")
    plainly = "bravo may not call acme-secret-70b; choose a model it may call."
    assert errors(wrong)["base"] == plainly


@pytest.mark.parametrize(
    "source",
    [
        "acme/support-v3-lora",
        "/root/.cache/huggingface/hub/models--acme--support-v3-lora",
        "/root/.cache/huggingface/hub/models--acme--support-v3-lora/snapshots/abc",
    ],
    ids=["its hub id", "its cache folder", "a folder inside it"],
)
def test_tenant_b_cannot_register_tenant_as_adapter_files_as_its_own(
    source: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    """Under a name of her own, tenant A's weights would be hers to call."""
    answer = client_for(world.carol).post(
        LIST, body(served_name="bravo/copy", source=source), format="json"
    )
    assert answer.status_code == 400
    assert errors(answer)["source"] == "These files are another adapter's; use your own."
    # Tenant A's own admin may register the same files again (a second name, say).
    again = client_for(world.alice).post(
        LIST, body(served_name="acme/copy", source=source), format="json"
    )
    assert again.status_code == 201, again.content


def test_an_adapter_that_was_billed_is_not_deleted(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    UsageEvent.objects.create(
        request_id=f"req-{uuid.uuid4().hex}",
        occurred_at=timezone.now() - timedelta(minutes=5),
        tenant=world.tenant_a,
        api_key=world.alice_key,
        model=world.public_model,
        adapter=world.adapter_a,
        prompt_tokens=10,
        completion_tokens=5,
        cost=Decimal("0.000010"),
    )
    answer = client_for(world.alice).delete(SUPPORT)
    assert answer.status_code == 409
    assert "make it private instead" in answer.json()["detail"]
    assert Adapter.objects.filter(pk=world.adapter_a.pk).exists()


# --- Check again ------------------------------------------------------------------------------


def test_a_failed_adapter_is_checked_again_on_request(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    Adapter.objects.filter(pk=world.adapter_a.pk).update(
        status=AdapterStatus.FAILED, status_message="No adapter weights found."
    )
    alice = client_for(world.alice)
    assert alice.post(SUPPORT + "check/", {"force": True}, format="json").status_code == 400
    checked = alice.post(SUPPORT + "check/")
    assert checked.status_code == 202, checked.content
    assert checked.json()["status"] == "checking"
    assert "No adapter weights" not in checked.json()["status_message"]
    assert alice.get(SUPPORT).json()["status"] == "checking"
    [entry] = audit("action", "acme/support-v3")
    assert (entry.actor, entry.tenant, entry.changes) == (
        world.alice,
        world.tenant_a,
        {"check": True},
    )
    assert client_for(world.bob).post(SUPPORT + "check/").status_code == 403
