"""The admission page: engine slots, queue by class, ceiling history, waits by tenant."""

import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from core.keyspace import pool_keys, wait_stats_key
from core.redis import get_redis
from deployments.choices import ReplicaState
from deployments.models import Deployment, Node, Replica
from gateway.models import AdmissionSample
from tenants.models import Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def busy_model(public_model: object, local_node: Node, tenant_a: Tenant) -> object:
    deployment = Deployment.objects.create(
        name="qwen-dep",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        engine_args={"max-num-seqs": 4},
        desired_state="running",
        state="ready",
    )
    Replica.objects.create(
        deployment=deployment,
        index=0,
        node=local_node,
        host="127.0.0.1",
        port=9,
        state=ReplicaState.READY,
        healthy=True,
    )
    client = get_redis()
    running, queue, _, _, ceiling, *_ = pool_keys(public_model.pk)
    client.zadd(running, {"r1": 9e15, "r2": 9e15, "r3": 9e15})
    client.zadd(queue, {"w0": 5.0, "w2a": 2e13 + 1, "w2b": 2e13 + 2})
    client.set(ceiling, 3)
    hour = int(time.time() // 3600)
    client.hset(
        wait_stats_key(hour), mapping={f"P2|{tenant_a.pk}|n": 4, f"P2|{tenant_a.pk}|s": "10.0"}
    )
    AdmissionSample.objects.create(
        model=public_model,
        at=timezone.now() - timedelta(seconds=5),
        budget=4,
        ceiling=3,
        decision="decrease",
        tokens_per_second=Decimal("812.5"),
        ttft_ms=420.0,
        engine_waiting=2,
        gateway_queued=3,
    )
    return public_model


def test_admins_see_slots_queue_ceiling_and_waits(
    web: object, root: object, busy_model: object
) -> None:
    page = web(root).get("/admission/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "qwen3-8b" in html
    assert ">4 requests<" in html and ">3 requests<" in html  # budget, ceiling and running
    assert "decrease" in html and "812.5 tok/s" in html and "420 ms" in html
    assert "Acme Research" in html and "2.50 s" in html  # 4 waits, 10 s in all


def test_tenant_users_may_not_see_it(web: object, alice: object, busy_model: object) -> None:
    assert web(alice).get("/admission/").status_code == 403


def test_joining_a_node_shows_the_command_once(web: object, root: object, alice: object) -> None:
    from deployments.models import JoinToken

    page = web(root).post("/nodes/join/", {"node_name": "spark-2", "control_plane": "10.0.0.1"})
    assert page.status_code == 200 and page["Cache-Control"] == "no-store"
    token = JoinToken.objects.get(node_name="spark-2")
    html = page.content.decode()
    assert f"tgj-{token.prefix}-" in html and "spark-2" in html
    bad = web(root).post("/nodes/join/", {"node_name": "Not A Name"})
    assert bad.status_code == 400 and "Lower-case letters" in bad.content.decode()
    assert web(alice).post("/nodes/join/", {"node_name": "sneaky"}).status_code == 403
    assert not JoinToken.objects.filter(node_name="sneaky").exists()
