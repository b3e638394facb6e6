"""CPU limits in the admin API: a deployment's ``cpus`` (Docker's --cpus for each engine
container) is written on create and ``PATCH`` and read back as a number; a profile's
``cpu_headroom`` is what it leaves free on the node. Bad values are a 400 naming the field,
and nothing is written. Tenant users see none of it.
"""

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from rest_framework.test import APIClient

from deployments.choices import OperationKind
from deployments.models import Deployment, EngineProfile, Operation
from deployments.profiles import ensure_builtin_profiles
from tenants.models import AuditLog
from tests.api.conftest import World

URL = "/api/v1/deployments/"


def _new(**extra: Any) -> dict[str, Any]:
    return {
        "name": "qwen-capped",
        "model": "qwen3-8b",
        "node": "spark-1",
        "image": "tollgate/engine-sim:latest",
        "engine_args": {"max-num-seqs": 4, "max-model-len": 4096},
        **extra,
    }


def _errors(answer: Any) -> dict[str, str]:
    """The 400 problem's messages by field."""
    return {e["field"]: e["message"] for e in answer.json()["errors"]}


def test_a_deployment_s_cpus_are_written_read_back_and_changing_them_replaces_its_engines(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    world.node.cpu_count = 20
    world.node.save()
    client = client_for(world.root)
    answer = client.post(URL, _new(cpus=1.5), format="json")
    assert answer.status_code == 201, answer.content[:500]
    assert answer.json()["cpus"] == 1.5
    assert Deployment.objects.get(name="qwen-capped").cpus == Decimal("1.5")
    assert client.post(URL, _new(name="uncapped"), format="json").json()["cpus"] is None

    changed = client.patch(f"{URL}qwen-capped/", {"cpus": 6}, format="json")
    assert changed.status_code == 200 and changed.json()["cpus"] == 6
    entry = AuditLog.objects.filter(object_type="deployment", action="update").latest("id")
    assert entry.changes["cpus"] == ["1.50", "6.00"]
    # A running engine keeps the limit it was created with: a new one replaces it.
    kinds = Operation.objects.filter(deployment__name="qwen-capped").values_list("kind", flat=True)
    assert OperationKind.RESTART in kinds


def test_bad_cpu_figures_are_a_400_naming_the_field_and_write_nothing(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    world.node.cpu_count = 2
    world.node.save()
    client = client_for(world.root)
    for body, why in (
        (_new(cpus=0), "greater than or equal to 0.1"),
        (_new(cpus="lots"), "A valid number is required"),
        (_new(cpus=3), "Node spark-1 has 2 CPU cores; give at most 2."),
        (
            {
                **_new(external=True, external_url="http://engine.internal:8000", cpus=1),
                "image": "",
            },
            "Tollgate does not start an external engine: it cannot limit its CPUs.",
        ),
    ):
        answer = client.post(URL, body, format="json")
        assert answer.status_code == 400 and why in _errors(answer)["cpus"], answer.content
    assert not Deployment.objects.filter(name="qwen-capped").exists()


def test_the_cpu_profile_leaves_half_a_core_and_an_admin_s_profile_may_leave_more(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    ensure_builtin_profiles()
    client = client_for(world.root)
    assert client.get("/api/v1/engine-profiles/cpu/").json()["cpu_headroom"] == 0.5
    assert client.get("/api/v1/engine-profiles/simulator/").json()["cpu_headroom"] is None
    body = {"name": "cpu-quiet", "image": "tollgate/vllm-cpu:0.32.0", "cpu_headroom": 1}
    answer = client.post("/api/v1/engine-profiles/", body, format="json")
    assert answer.status_code == 201 and answer.json()["cpu_headroom"] == 1
    assert EngineProfile.objects.get(name="cpu-quiet").cpu_headroom == Decimal("1")
    refused = client.post(
        "/api/v1/engine-profiles/", {**body, "name": "x", "cpu_headroom": -1}, format="json"
    )
    assert refused.status_code == 400
    assert "greater than or equal to 0" in _errors(refused)["cpu_headroom"]
    for user in (world.alice, world.carol):
        assert client_for(user).get("/api/v1/engine-profiles/cpu/").status_code in (403, 404)
