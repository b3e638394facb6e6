"""Who may reach what: every route and method of the admin API, for tenant B's admin and
tenant A's member.

Two tables, each covering every (route, method) the router serves (checked against the
router itself, so a new endpoint without a row here fails). Every refused call must also
leave every Tollgate table exactly as it was.
"""

import json
from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from tenants.models import AdminToken, AuditLog
from tests.api.conftest import Call, World, db_state, expected, router_endpoints

OK, CREATED, BAD, FORBIDDEN, NOT_FOUND, NOT_ALLOWED = 200, 201, 400, 403, 404, 405


def slug_a(w: World) -> str:
    return w.tenant_a.slug


def price_body(model: Callable[[World], Any]) -> Callable[[World], dict[str, Any]]:
    return lambda w: {
        "model": model(w).served_name,
        "input_per_mtok": "0",
        "output_per_mtok": "0",
    }


NODE_BODY = {"name": "spark-9", "docker_url": "tcp://spark-9:2375"}


def webhook_body(w: World) -> dict[str, Any]:
    return {"tenant": "acme", "url": "https://evil.test/hook", "events": ["budget.threshold"]}


def webhook_a(w: World) -> int:
    return w.webhook_a.pk


def delivery_a(w: World) -> str:
    return str(w.delivery_a.pk)


def notice_a(w: World) -> int:
    return w.notice_a.pk


# Tenant A's endpoint, by anyone but its admins: as if it did not exist.
WEBHOOK_CALLS = [
    ("webhookendpoint-detail", "GET", None),
    ("webhookendpoint-detail", "PATCH", lambda w: {"url": "https://evil.test/hook"}),
    ("webhookendpoint-detail", "DELETE", None),
    ("webhookendpoint-rotate-secret", "POST", None),
    ("webhookendpoint-test", "POST", None),
]


def adapter_a(w: World) -> str:
    return w.adapter_a.served_name


def adapter_body(tenant: str) -> Callable[[World], dict[str, Any]]:
    return lambda w: {
        "served_name": f"{tenant}/planted",
        "base": w.public_model.served_name,
        "tenant": tenant,
        "source": f"{tenant}/planted-lora",
    }


def deployment_body(w: World) -> dict[str, Any]:
    return {
        "name": "sneaky",
        "model": w.public_model.served_name,
        "image": "tollgate/engine-sim:latest",
    }


# Platform-only operations added with engine profiles and staging: 403 for every non-staff
# user, before any lookup (so the profile name need not exist), and nothing written.
PROFILE = "vllm-default"
PLATFORM_ONLY = [
    Call(
        "catalogmodel-stage",
        "POST",
        FORBIDDEN,
        lambda w: w.public_model.pk,
        lambda w: {"node": "spark-1", "image": "vllm/vllm-openai:v0.11.0"},
    ),
    Call("catalogmodel-staged", "GET", FORBIDDEN),
    Call("deployment-restart", "POST", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-remove", "POST", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-logs", "GET", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-operations", "GET", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-memory-fit", "GET", FORBIDDEN, lambda w: w.deployment.name),
    Call("engineprofile-list", "GET", FORBIDDEN),
    Call("engineprofile-list", "POST", FORBIDDEN, body=lambda w: {"name": "mine"}),
    Call("engineprofile-detail", "GET", FORBIDDEN, lambda w: PROFILE),
    Call("engineprofile-detail", "PUT", FORBIDDEN, lambda w: PROFILE, lambda w: {"name": "x"}),
    Call("engineprofile-detail", "PATCH", FORBIDDEN, lambda w: PROFILE, lambda w: {"name": "x"}),
    Call("engineprofile-detail", "DELETE", FORBIDDEN, lambda w: PROFILE),
    Call("node-join-token", "POST", FORBIDDEN, body=lambda w: {"node_name": "spark-9"}),
    Call("node-revoke", "POST", FORBIDDEN, lambda w: w.node.name),
    # Only a join token (Authorization: Bearer tgj-…) may call it; a user's login may not.
    Call(
        "node-join",
        "POST",
        (401, 403),
        body=lambda w: {"name": "spark-9", "engine_host": "h"},
    ),
    Call("allowedimage-list", "GET", FORBIDDEN),
    Call("allowedimage-list", "POST", FORBIDDEN, body=lambda w: {"pattern": "evil/miner:*"}),
    Call("allowedimage-detail", "GET", FORBIDDEN, lambda w: 1),
    Call("allowedimage-detail", "DELETE", FORBIDDEN, lambda w: 1),
]


# --- Tenant B's admin against tenant A's objects -------------------------------------------
#
# Another tenant's object is "not found" for every detail route, write and action; what is
# platform-only is 403 for everyone who is not staff; lists are checked for content below.

CAROL_CALLS = [
    # Tenants: a tenant admin cannot create tenants; tenant A does not exist for carol.
    Call("tenant-list", "GET", OK),
    Call("tenant-list", "POST", FORBIDDEN, body=lambda w: {"name": "Acme 2", "slug": "acme-2"}),
    Call("tenant-detail", "GET", NOT_FOUND, slug_a),
    Call("tenant-detail", "PUT", NOT_FOUND, slug_a, lambda w: {"name": "Owned", "slug": "acme"}),
    Call("tenant-detail", "PATCH", NOT_FOUND, slug_a, lambda w: {"name": "Owned"}),
    Call("tenant-detail", "DELETE", NOT_FOUND, slug_a),
    Call("tenant-suspend", "POST", NOT_FOUND, slug_a),
    Call("tenant-activate", "POST", NOT_FOUND, slug_a),
    Call("tenant-boost", "POST", NOT_FOUND, slug_a, lambda w: {"minutes": 30}),
    # Keys.
    Call("apikey-list", "GET", OK),
    Call("apikey-list", "POST", BAD, body=lambda w: {"tenant": "acme", "name": "planted"}),
    Call("apikey-detail", "GET", NOT_FOUND, lambda w: w.alice_key.pk),
    Call(
        "apikey-detail",
        "PUT",
        NOT_FOUND,
        lambda w: w.alice_key.pk,
        lambda w: {"tenant": "acme", "name": "renamed"},
    ),
    Call(
        "apikey-detail",
        "PATCH",
        NOT_FOUND,
        lambda w: w.alice_key.pk,
        lambda w: {"requests_per_minute": 1},
    ),
    Call("apikey-revoke", "POST", NOT_FOUND, lambda w: w.alice_key.pk),
    # Members.
    Call("membership-list", "GET", OK),
    Call(
        "membership-list",
        "POST",
        BAD,
        body=lambda w: {"tenant": "acme", "user": "carol", "role": "admin"},
    ),
    Call("membership-detail", "GET", NOT_FOUND, lambda w: w.alice_membership.pk),
    Call(
        "membership-detail",
        "PATCH",
        NOT_FOUND,
        lambda w: w.bob_membership.pk,
        lambda w: {"role": "admin"},
    ),
    Call("membership-detail", "DELETE", NOT_FOUND, lambda w: w.bob_membership.pk),
    # Users: platform-only.
    Call("user-list", "GET", FORBIDDEN),
    Call(
        "user-list",
        "POST",
        FORBIDDEN,
        body=lambda w: {"username": "mallory", "password": "a long enough passphrase 9"},
    ),
    Call("user-detail", "GET", FORBIDDEN, lambda w: w.alice.pk),
    Call("user-detail", "PATCH", FORBIDDEN, lambda w: w.alice.pk, lambda w: {"is_active": False}),
    # Admin tokens: only your own exist.
    Call("admintoken-list", "GET", OK),
    Call("admintoken-list", "POST", CREATED, body=lambda w: {"name": "mine"}, changes=True),
    Call("admintoken-detail", "GET", NOT_FOUND, lambda w: w.alice_token.pk),
    Call("admintoken-revoke", "POST", NOT_FOUND, lambda w: w.alice_token.pk),
    # Models: tenant A's private model does not exist for carol.
    Call("catalogmodel-list", "GET", OK),
    Call(
        "catalogmodel-list",
        "POST",
        FORBIDDEN,
        body=lambda w: {
            "served_name": "x",
            "source": "o/x",
            "params_billions": "1",
            "context_length": 4096,
        },
    ),
    Call("catalogmodel-detail", "GET", NOT_FOUND, lambda w: w.private_model_a.pk),
    Call(
        "catalogmodel-detail",
        "PUT",
        NOT_FOUND,
        lambda w: w.private_model_a.pk,
        lambda w: {
            "served_name": "acme-secret-70b",
            "source": "o/x",
            "params_billions": "1",
            "context_length": 4096,
            "visibility": "public",
        },
    ),
    Call(
        "catalogmodel-detail",
        "PATCH",
        NOT_FOUND,
        lambda w: w.private_model_a.pk,
        lambda w: {"visibility": "public"},
    ),
    Call("catalogmodel-detail", "DELETE", NOT_FOUND, lambda w: w.private_model_a.pk),
    Call(
        "catalogmodel-grant",
        "POST",
        NOT_FOUND,
        lambda w: w.private_model_a.pk,
        lambda w: {"tenant": "bravo"},
    ),
    Call(
        "catalogmodel-ungrant",
        "POST",
        NOT_FOUND,
        lambda w: w.private_model_a.pk,
        lambda w: {"tenant": "acme"},
    ),
    # Adapters: tenant A's private adapter does not exist for carol, by name or by id; nor
    # does tenant A as an owner she could register one for.
    Call("adapter-list", "GET", OK),
    Call("adapter-list", "POST", BAD, body=adapter_body("acme")),
    Call("adapter-detail", "GET", NOT_FOUND, adapter_a),
    Call("adapter-detail", "GET", NOT_FOUND, lambda w: w.adapter_a.pk, note="by id"),
    Call("adapter-detail", "PATCH", NOT_FOUND, adapter_a, lambda w: {"tenant": "bravo"}),
    Call("adapter-detail", "DELETE", NOT_FOUND, adapter_a),
    Call("adapter-grant", "POST", NOT_FOUND, adapter_a, lambda w: {"tenant": "bravo"}),
    Call("adapter-ungrant", "POST", NOT_FOUND, adapter_a, lambda w: {"tenant": "acme"}),
    Call("adapter-check", "POST", NOT_FOUND, adapter_a),
    Call("adapter-upload", "POST", NOT_FOUND, adapter_a),
    # Prices: writes are platform-only; tenant A's private model's price does not exist.
    Call("price-list", "GET", OK),
    Call("price-list", "POST", FORBIDDEN, body=price_body(lambda w: w.private_model_a)),
    Call("price-detail", "GET", NOT_FOUND, lambda w: w.private_price_a.pk),
    # Nodes, deployments, operations: platform-only.
    Call("node-list", "GET", FORBIDDEN),
    Call("node-list", "POST", FORBIDDEN, body=lambda w: NODE_BODY),
    Call("node-detail", "GET", FORBIDDEN, lambda w: w.node.pk),
    Call("node-detail", "PUT", FORBIDDEN, lambda w: w.node.pk, lambda w: NODE_BODY),
    Call("node-detail", "PATCH", FORBIDDEN, lambda w: w.node.pk, lambda w: {"status": "disabled"}),
    Call("node-detail", "DELETE", FORBIDDEN, lambda w: w.node.pk),
    Call("deployment-list", "GET", FORBIDDEN),
    Call("deployment-list", "POST", FORBIDDEN, body=deployment_body),
    Call("deployment-detail", "GET", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-detail", "PUT", FORBIDDEN, lambda w: w.deployment.name, deployment_body),
    Call(
        "deployment-detail",
        "PATCH",
        FORBIDDEN,
        lambda w: w.deployment.name,
        lambda w: {"replicas": 4},
    ),
    Call("deployment-detail", "DELETE", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-start", "POST", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-stop", "POST", FORBIDDEN, lambda w: w.deployment.name),
    Call("operation-list", "GET", FORBIDDEN),
    Call("operation-detail", "GET", FORBIDDEN, lambda w: w.operation.pk),
    # Usage and audit: tenant A's rows do not exist for carol.
    Call("usageevent-list", "GET", OK),
    Call("usageevent-detail", "GET", NOT_FOUND, lambda w: w.usage_alice.request_id),
    Call("auditlog-list", "GET", OK),
    Call("auditlog-detail", "GET", NOT_FOUND, lambda w: w.audit_a.pk),
    # Webhooks, their deliveries and notices: tenant A's do not exist for tenant B.
    Call("webhookendpoint-list", "GET", OK),
    Call("webhookendpoint-list", "POST", BAD, body=webhook_body, note="for tenant A"),
    *[Call(route, method, NOT_FOUND, webhook_a, body) for route, method, body in WEBHOOK_CALLS],
    Call("webhookdelivery-list", "GET", OK),
    Call("webhookdelivery-detail", "GET", NOT_FOUND, delivery_a),
    Call("webhookdelivery-retry", "POST", NOT_FOUND, delivery_a),
    Call("notice-list", "GET", OK),
    Call("notice-detail", "GET", NOT_FOUND, notice_a),
    Call("notice-acknowledge", "POST", NOT_FOUND, notice_a),
    *PLATFORM_ONLY,
]


# --- Tenant A's member -----------------------------------------------------------------
#
# Reads what a member may read; every admin-only or platform-only thing is 403. Bob sees
# only the keys (and their usage) he made himself, so alice's are "not found" for him.

BOB_CALLS = [
    Call("tenant-list", "GET", OK),
    Call("tenant-list", "POST", FORBIDDEN, body=lambda w: {"name": "Bob Co", "slug": "bob-co"}),
    Call("tenant-detail", "GET", OK, slug_a),
    Call(
        "tenant-detail",
        "PUT",
        FORBIDDEN,
        slug_a,
        lambda w: {"name": "Acme", "slug": "acme", "requests_per_minute": 100000},
    ),
    Call(
        "tenant-detail",
        "PATCH",
        FORBIDDEN,
        slug_a,
        lambda w: {"quota_tokens": None, "priority": "P0"},
    ),
    Call("tenant-detail", "DELETE", FORBIDDEN, slug_a),
    Call("tenant-suspend", "POST", FORBIDDEN, slug_a),
    Call("tenant-activate", "POST", FORBIDDEN, slug_a),
    Call("tenant-boost", "POST", FORBIDDEN, slug_a, lambda w: {"minutes": 30}),
    Call("apikey-list", "GET", OK),
    Call("apikey-list", "POST", FORBIDDEN, body=lambda w: {"tenant": "acme", "name": "mine"}),
    Call("apikey-detail", "GET", OK, lambda w: w.bob_key.pk),
    Call("apikey-detail", "GET", NOT_FOUND, lambda w: w.alice_key.pk, note="admin's key"),
    Call(
        "apikey-detail",
        "PUT",
        FORBIDDEN,
        lambda w: w.bob_key.pk,
        lambda w: {"tenant": "acme", "name": "renamed"},
    ),
    Call(
        "apikey-detail",
        "PATCH",
        FORBIDDEN,
        lambda w: w.bob_key.pk,
        lambda w: {"name": "renamed", "expires_at": None},
    ),
    Call("apikey-revoke", "POST", FORBIDDEN, lambda w: w.bob_key.pk),
    Call("membership-list", "GET", OK),
    Call(
        "membership-list",
        "POST",
        FORBIDDEN,
        body=lambda w: {"tenant": "acme", "user": "dave", "role": "admin"},
    ),
    Call("membership-detail", "GET", OK, lambda w: w.alice_membership.pk),
    Call(
        "membership-detail",
        "PATCH",
        FORBIDDEN,
        lambda w: w.bob_membership.pk,
        lambda w: {"role": "admin"},
    ),
    Call("membership-detail", "DELETE", FORBIDDEN, lambda w: w.alice_membership.pk),
    Call("user-list", "GET", FORBIDDEN),
    Call(
        "user-list",
        "POST",
        FORBIDDEN,
        body=lambda w: {"username": "mallory", "password": "a long enough passphrase 9"},
    ),
    Call("user-detail", "GET", FORBIDDEN, lambda w: w.bob.pk),
    Call("user-detail", "PATCH", FORBIDDEN, lambda w: w.bob.pk, lambda w: {"is_staff": True}),
    # Admin tokens are the caller's own: a member manages his.
    Call("admintoken-list", "GET", OK),
    Call("admintoken-list", "POST", CREATED, body=lambda w: {"name": "bob-ci"}, changes=True),
    Call("admintoken-detail", "GET", NOT_FOUND, lambda w: w.alice_token.pk),
    Call("admintoken-revoke", "POST", NOT_FOUND, lambda w: w.alice_token.pk),
    Call("catalogmodel-list", "GET", OK),
    Call(
        "catalogmodel-list",
        "POST",
        FORBIDDEN,
        body=lambda w: {
            "served_name": "x",
            "source": "o/x",
            "params_billions": "1",
            "context_length": 4096,
        },
    ),
    Call("catalogmodel-detail", "GET", OK, lambda w: w.private_model_a.pk),
    Call(
        "catalogmodel-detail",
        "PUT",
        FORBIDDEN,
        lambda w: w.public_model.pk,
        lambda w: {
            "served_name": "qwen3-8b",
            "source": "o/x",
            "params_billions": "1",
            "context_length": 4096,
        },
    ),
    Call(
        "catalogmodel-detail",
        "PATCH",
        FORBIDDEN,
        lambda w: w.public_model.pk,
        lambda w: {"context_length": 1024},
    ),
    Call("catalogmodel-detail", "DELETE", FORBIDDEN, lambda w: w.public_model.pk),
    Call(
        "catalogmodel-grant",
        "POST",
        FORBIDDEN,
        lambda w: w.private_model_a.pk,
        lambda w: {"tenant": "bravo"},
    ),
    Call(
        "catalogmodel-ungrant",
        "POST",
        FORBIDDEN,
        lambda w: w.private_model_a.pk,
        lambda w: {"tenant": "acme"},
    ),
    # Adapters: a member reads his tenant's and changes none.
    Call("adapter-list", "GET", OK),
    Call("adapter-list", "POST", FORBIDDEN, body=adapter_body("acme")),
    Call("adapter-detail", "GET", OK, adapter_a),
    Call("adapter-detail", "PATCH", FORBIDDEN, adapter_a, lambda w: {"description": "mine"}),
    Call("adapter-detail", "DELETE", FORBIDDEN, adapter_a),
    Call("adapter-grant", "POST", FORBIDDEN, adapter_a, lambda w: {"tenant": "bravo"}),
    Call("adapter-ungrant", "POST", FORBIDDEN, adapter_a, lambda w: {"tenant": "acme"}),
    Call("adapter-check", "POST", FORBIDDEN, adapter_a),
    Call("adapter-upload", "POST", FORBIDDEN, adapter_a),
    Call("price-list", "GET", OK),
    Call("price-list", "POST", FORBIDDEN, body=price_body(lambda w: w.public_model)),
    Call("price-detail", "GET", OK, lambda w: w.private_price_a.pk),
    Call("node-list", "GET", FORBIDDEN),
    Call("node-list", "POST", FORBIDDEN, body=lambda w: NODE_BODY),
    Call("node-detail", "GET", FORBIDDEN, lambda w: w.node.pk),
    Call("node-detail", "PUT", FORBIDDEN, lambda w: w.node.pk, lambda w: NODE_BODY),
    Call("node-detail", "PATCH", FORBIDDEN, lambda w: w.node.pk, lambda w: {"status": "disabled"}),
    Call("node-detail", "DELETE", FORBIDDEN, lambda w: w.node.pk),
    Call("deployment-list", "GET", FORBIDDEN),
    Call("deployment-list", "POST", FORBIDDEN, body=deployment_body),
    Call("deployment-detail", "GET", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-detail", "PUT", FORBIDDEN, lambda w: w.deployment.name, deployment_body),
    Call(
        "deployment-detail",
        "PATCH",
        FORBIDDEN,
        lambda w: w.deployment.name,
        lambda w: {"replicas": 4},
    ),
    Call("deployment-detail", "DELETE", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-start", "POST", FORBIDDEN, lambda w: w.deployment.name),
    Call("deployment-stop", "POST", FORBIDDEN, lambda w: w.deployment.name),
    Call("operation-list", "GET", FORBIDDEN),
    Call("operation-detail", "GET", FORBIDDEN, lambda w: w.operation.pk),
    Call("usageevent-list", "GET", OK),
    Call("usageevent-detail", "GET", OK, lambda w: w.usage_bob.request_id),
    Call(
        "usageevent-detail",
        "GET",
        NOT_FOUND,
        lambda w: w.usage_alice.request_id,
        note="admin's key",
    ),
    # The audit log is for tenant admins: a member gets nothing from it.
    Call("auditlog-list", "GET", OK),
    Call("auditlog-detail", "GET", (FORBIDDEN, NOT_FOUND), lambda w: w.audit_a.pk),
    # Webhooks, deliveries and notices are for tenant admins: a member sees none of them.
    Call("webhookendpoint-list", "GET", OK),
    Call("webhookendpoint-list", "POST", FORBIDDEN, body=webhook_body),
    *[Call(route, method, NOT_FOUND, webhook_a, body) for route, method, body in WEBHOOK_CALLS],
    Call("webhookdelivery-list", "GET", OK),
    Call("webhookdelivery-detail", "GET", NOT_FOUND, delivery_a),
    Call("webhookdelivery-retry", "POST", NOT_FOUND, delivery_a),
    Call("notice-list", "GET", OK),
    Call("notice-detail", "GET", NOT_FOUND, notice_a),
    Call("notice-acknowledge", "POST", NOT_FOUND, notice_a),
    *PLATFORM_ONLY,
]


def _send_and_check_db(call: Call, client: APIClient, world: World) -> Any:
    before = db_state()
    response = call.send(client, world)
    assert response.status_code in expected(call.status), response.content[:300]
    if not call.changes:
        assert db_state() == before, "a refused or read-only call changed the database"
    return response


@pytest.mark.parametrize("call", CAROL_CALLS, ids=lambda c: c.id)
def test_tenant_b_admin_cannot_reach_tenant_a(
    call: Call, world: World, client_for: Callable[..., APIClient]
) -> None:
    response = _send_and_check_db(call, client_for(world.carol), world)
    # Whatever the answer, nothing of tenant A is in it (a problem's ``instance`` is only
    # the path Carol asked for herself, so it is left out of the search).
    body = response.content.decode()
    if response["Content-Type"] == "application/problem+json":
        body = json.dumps({k: v for k, v in response.json().items() if k != "instance"})
    for secret in [
        '"acme"',
        "Acme Research",
        "acme-secret-70b",
        world.alice_key.prefix,
        '"alice"',
        world.usage_alice.request_id,
    ]:
        assert secret not in body


@pytest.mark.parametrize("call", BOB_CALLS, ids=lambda c: c.id)
def test_tenant_a_member_reads_but_cannot_administer(
    call: Call, world: World, client_for: Callable[..., APIClient]
) -> None:
    _send_and_check_db(call, client_for(world.bob), world)


@pytest.mark.parametrize("table", [CAROL_CALLS, BOB_CALLS], ids=["tenant B admin", "member"])
def test_tables_cover_every_route_and_method_of_the_router(table: list[Call]) -> None:
    covered = {(call.route, call.method) for call in table}
    assert router_endpoints() - covered == set()
    assert covered - router_endpoints() == set(), "a row names a route the router lacks"


def test_key_and_membership_creation_for_another_tenant_reads_like_an_unknown_tenant(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """Carol learns nothing from the answer: 'acme' is as unknown to her as 'nope'."""
    carol = client_for(world.carol)
    for path, body in [
        ("/api/v1/keys/", {"name": "planted"}),
        ("/api/v1/members/", {"user": "carol", "role": "admin"}),
    ]:
        acme = carol.post(path, {**body, "tenant": "acme"}, format="json")
        nope = carol.post(path, {**body, "tenant": "nope"}, format="json")
        assert acme.status_code == nope.status_code == 400
        assert acme.json() == json.loads(json.dumps(nope.json()).replace("nope", "acme"))
        assert any(e["field"] == "tenant" for e in acme.json()["errors"])


def test_a_private_model_of_tenant_a_reads_like_an_unknown_model_in_carols_key_requests(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """Restricting her key to tenant A's private model must not confirm that model exists."""
    carol = client_for(world.carol)
    answers = {}
    for name in ["acme-secret-70b", "no-such-model"]:
        body = {"tenant": "bravo", "name": "probe", "allowed_models": [name]}
        response = carol.post("/api/v1/keys/", body, format="json")
        assert response.status_code == 400
        errors = [e for e in response.json()["errors"] if e["field"] == "allowed_models"]
        assert errors, response.json()
        answers[name] = response.content.decode().replace(name, "<name>")
    assert answers["acme-secret-70b"] == answers["no-such-model"]


def test_api_keys_cannot_be_deleted_only_revoked(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """There is no DELETE on keys (usage refers to them); a tenant admin's attempt is 405."""
    calls = [
        (client_for(world.alice), world.alice_key, 405),
        (client_for(world.root), world.carol_key, 405),
        (client_for(world.carol), world.alice_key, (404, 405)),
    ]
    before = db_state()
    for client, key, status in calls:
        assert client.delete(f"/api/v1/keys/{key.pk}/").status_code in expected(status)
    assert db_state() == before


# --- What each list shows -------------------------------------------------------------
#
# (who, list, field identifying a row, rows that must be there, rows that must not).
# The "must be there" half keeps the test honest: an empty list would pass "must not".


def _tokens_of(user: str) -> Callable[[World], list[Any]]:
    return lambda w: list(
        AdminToken.objects.filter(user=getattr(w, user)).values_list("pk", flat=True)
    )


def _audit(**filters: Any) -> Callable[[World], list[Any]]:
    return lambda w: list(
        AuditLog.objects.filter(
            **{k: v(w) if callable(v) else v for k, v in filters.items()}
        ).values_list("pk", flat=True)
    )


LISTS = [
    ("carol", "tenants", "slug", lambda w: ["bravo"], lambda w: ["acme"]),
    (
        "carol",
        "keys",
        "prefix",
        lambda w: [w.carol_key.prefix],
        lambda w: [w.alice_key.prefix, w.bob_key.prefix],
    ),
    (
        "carol",
        "members",
        "id",
        lambda w: [w.carol_membership.pk],
        lambda w: [w.alice_membership.pk, w.bob_membership.pk],
    ),
    ("carol", "tokens", "id", _tokens_of("carol"), _tokens_of("alice")),
    (
        "carol",
        "models",
        "served_name",
        lambda w: ["qwen3-8b", "bravo-private-7b"],
        lambda w: ["acme-secret-70b"],
    ),
    ("carol", "prices", "id", lambda w: [w.public_price.pk], lambda w: [w.private_price_a.pk]),
    (
        "carol",
        "usage",
        "request_id",
        lambda w: [w.usage_carol.request_id],
        lambda w: [w.usage_alice.request_id, w.usage_bob.request_id],
    ),
    (
        "carol",
        "audit",
        "id",
        _audit(tenant=lambda w: w.tenant_b),
        lambda w: _audit(tenant=w.tenant_a)(w) + _audit(tenant__isnull=True)(w),
    ),
    ("bob", "tenants", "slug", lambda w: ["acme"], lambda w: ["bravo"]),
    (
        "bob",
        "keys",
        "prefix",
        lambda w: [w.bob_key.prefix],
        lambda w: [w.alice_key.prefix, w.carol_key.prefix],
    ),
    (
        "bob",
        "members",
        "id",
        lambda w: [w.alice_membership.pk, w.bob_membership.pk],
        lambda w: [w.carol_membership.pk],
    ),
    ("bob", "tokens", "id", _tokens_of("bob"), _tokens_of("alice")),
    (
        "bob",
        "models",
        "served_name",
        lambda w: ["qwen3-8b", "acme-secret-70b"],
        lambda w: ["bravo-private-7b"],
    ),
    ("bob", "prices", "id", lambda w: [w.public_price.pk, w.private_price_a.pk], lambda w: []),
    (
        "bob",
        "usage",
        "request_id",
        lambda w: [w.usage_bob.request_id],
        lambda w: [w.usage_alice.request_id, w.usage_carol.request_id],
    ),
    ("bob", "audit", "id", lambda w: [], _audit()),
    (
        "alice",
        "keys",
        "prefix",
        lambda w: [w.alice_key.prefix, w.bob_key.prefix],
        lambda w: [w.carol_key.prefix],
    ),
    (
        "alice",
        "usage",
        "request_id",
        lambda w: [w.usage_alice.request_id, w.usage_bob.request_id],
        lambda w: [w.usage_carol.request_id],
    ),
    (
        "alice",
        "audit",
        "id",
        _audit(tenant=lambda w: w.tenant_a),
        lambda w: _audit(tenant=w.tenant_b)(w) + _audit(tenant__isnull=True)(w),
    ),
    (
        "alice",
        "members",
        "id",
        lambda w: [w.alice_membership.pk, w.bob_membership.pk],
        lambda w: [w.carol_membership.pk],
    ),
    (
        "root",
        "keys",
        "prefix",
        lambda w: [w.alice_key.prefix, w.bob_key.prefix, w.carol_key.prefix],
        lambda w: [],
    ),
    (
        "root",
        "usage",
        "request_id",
        lambda w: [w.usage_alice.request_id, w.usage_bob.request_id, w.usage_carol.request_id],
        lambda w: [],
    ),
    (
        "root",
        "models",
        "served_name",
        lambda w: ["qwen3-8b", "acme-secret-70b", "bravo-private-7b"],
        lambda w: [],
    ),
    ("root", "tenants", "slug", lambda w: ["acme", "bravo"], lambda w: []),
]


@pytest.mark.parametrize(
    ("who", "resource", "field", "present", "absent"),
    LISTS,
    ids=[f"{row[0]} {row[1]}" for row in LISTS],
)
def test_lists_show_exactly_the_rows_the_user_may_see(
    who: str,
    resource: str,
    field: str,
    present: Callable[[World], list[Any]],
    absent: Callable[[World], list[Any]],
    world: World,
    client_for: Callable[..., APIClient],
) -> None:
    client = client_for(getattr(world, who))
    response = client.get(f"/api/v1/{resource}/", {"limit": 1000})
    assert response.status_code == 200
    shown = {row[field] for row in response.json()["results"]}
    assert set(present(world)) <= shown
    assert not set(absent(world)) & shown


@pytest.mark.parametrize(
    ("resource", "query"),
    [
        ("keys", {"tenant__slug": "acme"}),
        ("members", {"tenant__slug": "acme"}),
        ("usage", {"tenant__slug": "acme"}),
        ("audit", {"tenant__slug": "acme"}),
        ("models", {"served_name": "acme-secret-70b"}),
        ("adapters", {"tenant__slug": "acme"}),
        ("prices", {"model__served_name": "acme-secret-70b"}),
        ("usage", {"model__served_name": "acme-secret-70b"}),
    ],
)
def test_filtering_by_tenant_a_gives_tenant_b_an_empty_list(
    resource: str, query: dict[str, str], world: World, client_for: Callable[..., APIClient]
) -> None:
    response = client_for(world.carol).get(f"/api/v1/{resource}/", query)
    assert response.status_code == 200
    assert response.json()["count"] == 0
    # The same filter finds tenant A's rows for its admin, so the filter itself works.
    assert client_for(world.root).get(f"/api/v1/{resource}/", query).json()["count"] > 0
