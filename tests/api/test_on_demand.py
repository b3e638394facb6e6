"""On-demand deployments in the admin API: ``mode`` and its two timeouts are written on
create and ``PATCH``; ``awake``, ``last_used_at`` and ``demand_state`` are read-only; a node
shows its memory budget. Bad values are a 400 problem naming the field, and nothing is
written. Tenant users (alice, bob, carol) see and change none of it.
"""

from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from deployments import demand
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from tenants.models import AuditLog
from tests.api.conftest import World, db_state

URL = "/api/v1/deployments/"


def _detail(name: str) -> str:
    return f"{URL}{name}/"


def _new(**extra: Any) -> dict[str, Any]:
    return {
        "name": "qwen-lazy",
        "model": "qwen3-8b",
        "node": "spark-1",
        "image": "tollgate/engine-sim:latest",
        "engine_args": {"max-num-seqs": 4, "max-model-len": 4096},
        **extra,
    }


def test_an_admin_creates_an_on_demand_deployment(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    body = _new(mode="on_demand", idle_timeout_seconds=300, start_timeout_seconds=120)
    answer = client_for(world.root).post(URL, body, format="json")
    assert answer.status_code == 201, answer.content[:500]
    data = answer.json()
    assert (data["mode"], data["idle_timeout_seconds"], data["start_timeout_seconds"]) == (
        "on_demand",
        300,
        120,
    )
    # Nothing asked for it yet: not awake, never used, unloaded.
    assert (data["awake"], data["last_used_at"], data["demand_state"]) == (False, None, "unloaded")
    saved = Deployment.objects.get(name="qwen-lazy")
    assert (saved.mode, saved.idle_timeout_seconds, saved.start_timeout_seconds) == (
        "on_demand",
        300,
        120,
    )
    listed = client_for(world.root).get(URL, {"mode": "on_demand"}).json()["results"]
    assert [d["name"] for d in listed] == ["qwen-lazy"]  # not qwen-main, always running


def test_defaults_are_always_running_with_the_documented_timeouts(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    data = client_for(world.root).post(URL, _new(), format="json").json()
    assert (data["mode"], data["idle_timeout_seconds"], data["start_timeout_seconds"]) == (
        "always",
        900,
        600,
    )
    assert data["demand_state"] == ""


def test_patch_switches_a_deployment_to_on_demand_and_the_audit_log_says_so(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(world.root)
    answer = client.patch(
        _detail("qwen-main"),
        {"mode": "on_demand", "idle_timeout_seconds": 60, "start_timeout_seconds": 30},
        format="json",
    )
    assert answer.status_code == 200, answer.content[:500]
    # It was meant to run (its replica is placed): it stays awake until its idle timeout.
    assert answer.json()["mode"] == "on_demand" and answer.json()["awake"] is True
    assert answer.json()["demand_state"] == "loading"
    world.deployment.refresh_from_db()
    assert (world.deployment.mode, world.deployment.idle_timeout_seconds) == ("on_demand", 60)
    assert world.deployment.start_timeout_seconds == 30
    entry = AuditLog.objects.filter(object_type="deployment", action="update").latest("id")
    assert entry.changes["mode"] == ["always", "on_demand"]
    assert entry.changes["idle_timeout_seconds"] == [900, 60]

    back = client.patch(_detail("qwen-main"), {"mode": "always"}, format="json")
    assert back.status_code == 200 and back.json()["demand_state"] == ""


def test_demand_state_follows_the_replicas(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """The worker sets ``awake`` and the replica's state; here they are set by hand."""
    client = client_for(world.root)
    client.patch(_detail("qwen-main"), {"mode": "on_demand"}, format="json")
    used = timezone.now().replace(microsecond=0)
    Deployment.objects.filter(pk=world.deployment.pk).update(awake=True, last_used_at=used)
    Replica.objects.filter(deployment=world.deployment).delete()
    replica = Replica.objects.create(
        deployment=world.deployment, index=0, node=world.node, state=ReplicaState.LOADING
    )
    data = client.get(_detail("qwen-main")).json()
    assert (data["awake"], data["demand_state"]) == (True, "loading")
    assert data["last_used_at"].startswith(used.strftime("%Y-%m-%dT%H:%M:%S"))
    replica.state = ReplicaState.READY
    replica.save()
    assert client.get(_detail("qwen-main")).json()["demand_state"] == "loaded"
    listed = client.get(URL, {"name": "qwen-main"}).json()["results"]
    assert [(d["name"], d["demand_state"]) for d in listed] == [("qwen-main", "loaded")]
    world.deployment.refresh_from_db()
    assert listed[0]["demand_state"] == demand.demand_state(world.deployment)


@pytest.mark.parametrize(
    "body",
    [
        {"awake": True},
        {"last_used_at": "2026-11-28T12:00:00Z"},
        {"demand_state": "loaded"},
    ],
    ids=["awake", "last_used_at", "demand_state"],
)
def test_what_the_worker_decides_is_read_only(
    body: dict[str, Any], world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(world.root)
    before = db_state()
    answer = client.patch(_detail("qwen-main"), body, format="json")
    assert answer.status_code == 400
    assert answer["Content-Type"] == "application/problem+json"
    [field] = body
    assert [e["message"] for e in answer.json()["errors"] if e["field"] == field] == [
        "This field is read-only."
    ]
    assert db_state() == before


BAD = [
    ("mode", {"mode": "sometimes"}),
    ("mode", {"mode": ""}),
    ("idle_timeout_seconds", {"idle_timeout_seconds": 9}),
    ("idle_timeout_seconds", {"idle_timeout_seconds": 86_401}),
    ("idle_timeout_seconds", {"idle_timeout_seconds": "a while"}),
    ("start_timeout_seconds", {"start_timeout_seconds": 0}),
    ("start_timeout_seconds", {"start_timeout_seconds": -60}),
    ("start_timeout_seconds", {"start_timeout_seconds": 10**6}),
]


@pytest.mark.parametrize("how", ["create", "patch"])
@pytest.mark.parametrize(("field", "body"), BAD, ids=[f"{f}={b[f]!r}" for f, b in BAD])
def test_bad_values_are_a_problem_naming_the_field(
    how: str,
    field: str,
    body: dict[str, Any],
    world: World,
    client_for: Callable[..., APIClient],
) -> None:
    client = client_for(world.root)
    before = db_state()
    if how == "create":
        answer = client.post(URL, _new(**body), format="json")
    else:
        answer = client.patch(_detail("qwen-main"), body, format="json")
    assert answer.status_code == 400, answer.content[:500]
    assert answer["Content-Type"] == "application/problem+json"
    messages = [e["message"] for e in answer.json()["errors"] if e["field"] == field]
    assert messages and all(m.strip() for m in messages), answer.json()
    assert db_state() == before


def test_an_external_engine_cannot_be_on_demand(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """Tollgate does not start or stop an external engine, so it cannot load it on demand."""
    client = client_for(world.root)
    before = db_state()
    body = {
        "name": "remote",
        "model": "qwen3-8b",
        "external": True,
        "external_url": "http://10.0.0.20:8000",
        "mode": "on_demand",
    }
    answer = client.post(URL, body, format="json")
    assert answer.status_code == 400, answer.content[:500]
    assert [e["field"] for e in answer.json()["errors"]] == ["mode"]
    assert db_state() == before

    made = client.post(URL, {**body, "mode": "always"}, format="json")
    assert made.status_code == 201, made.content[:500]
    refused = client.patch(_detail("remote"), {"mode": "on_demand"}, format="json")
    assert refused.status_code == 400
    assert [e["field"] for e in refused.json()["errors"]] == ["mode"]
    assert Deployment.objects.get(name="remote").mode == "always"


def test_a_node_shows_its_memory_budget_read_only(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(world.root)
    client.post(URL, _new(mode="on_demand"), format="json")
    data = client.get("/api/v1/nodes/spark-1/").json()
    budget = data["memory_budget"]
    assert budget == demand.node_budget(world.node)
    # qwen-main runs always; the on-demand one holds nothing until a request wakes it.
    assert budget["usable_bytes"] > budget["always_bytes"] > 0 and budget["on_demand_bytes"] == 0
    assert budget["free_bytes"] == budget["usable_bytes"] - budget["always_bytes"]
    Deployment.objects.filter(name="qwen-lazy").update(awake=True)
    awake = client.get("/api/v1/nodes/spark-1/").json()["memory_budget"]
    assert awake["on_demand_bytes"] > 0
    assert awake["free_bytes"] == budget["free_bytes"] - awake["on_demand_bytes"]
    listed = client.get("/api/v1/nodes/").json()["results"]
    assert listed[0]["memory_budget"] == awake

    before = db_state()
    refused = client.patch("/api/v1/nodes/spark-1/", {"memory_budget": {}}, format="json")
    assert refused.status_code == 400
    assert [e["field"] for e in refused.json()["errors"]] == ["memory_budget"]
    assert db_state() == before


@pytest.mark.parametrize("who", ["alice", "bob", "carol"])
def test_tenant_users_neither_see_nor_change_it(
    who: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(getattr(world, who))
    before = db_state()
    for answer in (
        client.get(URL),
        client.get(_detail("qwen-main")),
        client.get("/api/v1/nodes/spark-1/"),
        client.post(URL, _new(mode="on_demand"), format="json"),
        client.patch(_detail("qwen-main"), {"mode": "on_demand"}, format="json"),
        client.patch(_detail("qwen-main"), {"idle_timeout_seconds": 60}, format="json"),
    ):
        assert answer.status_code == 403, answer.content[:300]
        assert set(answer.json()) == {"type", "title", "status", "detail", "instance"}
    assert db_state() == before
