"""The bill's check against the engines as admins read it: the deployment page, the
dashboard and the admin API (the checking itself: tests/metering/test_engine_ledger.py)."""

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from deployments.choices import ReplicaState
from deployments.models import Deployment, Node, Replica
from metering.engine_ledger import Mark, State
from metering.models import EngineLedger

pytestmark = pytest.mark.django_db


def u(name: str, *args: object) -> str:
    return reverse(f"console:{name}", args=args)


@pytest.fixture
def served(public_model: Any, local_node: Node) -> Deployment:
    """A deployment of two replicas: #0 whose bill held for an hour then drifted, #1 an
    external-like engine without counters."""
    deployment = Deployment.objects.create(
        name="qwen-main", model=public_model, node=local_node, image="tollgate/engine-sim:latest"
    )
    good, bare = (
        Replica.objects.create(
            deployment=deployment, index=i, node=local_node, state=ReplicaState.READY, port=9000 + i
        )
        for i in (0, 1)
    )
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    common = {"deployment": deployment, "deployment_name": deployment.name, "replica_index": 0}
    EngineLedger.objects.create(
        replica_id=good.pk,
        hour=hour - timedelta(hours=1),
        checks=12,
        requests=340,
        engine_prompt=51_200,
        billed_prompt=51_200,
        engine_generation=20_480,
        billed_generation=20_470,
        cut_requests=2,
        undelivered_generation=10,
        **common,
    )
    EngineLedger.objects.create(
        replica_id=good.pk,
        hour=hour,
        checks=3,
        requests=5,
        engine_prompt=700,
        billed_prompt=500,
        engine_generation=90,
        billed_generation=60,
        drift_prompt=200,
        drift_generation=30,
        drift_checks=1,
        restarts=1,
        unverified_prompt=40,
        unverified_generation=8,
        **common,
    )
    State(base=_mark(), last=_mark()).save(good.pk)
    State(counters=False).save(bare.pk)
    return deployment


def _mark() -> Mark:
    return Mark(
        at=timezone.now().timestamp(),
        incarnation="c@1",
        prompt=0,
        cached=0,
        generation=0,
        stream_id="1-0",
        quiet=True,
    )


def test_the_deployment_page_shows_each_replicas_check(
    served: Deployment, web: Callable, root: Any
) -> None:
    page = web(root).get(u("deployment-detail", "qwen-main")).content.decode()
    card = page[page.index('id="bill-check"') :]
    assert "Drift: the bill and the engine disagree" in card
    assert "200 in, 30 out, 0 cached" in card  # the drift, this hour
    assert "1 engine restart" in card
    assert "exports no token counters" in card  # replica #1
    assert "2 cut early" in card


def test_the_dashboard_lists_the_replicas_and_their_drift(
    served: Deployment, web: Callable, root: Any
) -> None:
    page = web(root).get(u("dashboard")).content.decode()
    card = page[page.index('id="bill-check"') :]
    assert "qwen-main #0" in card and "qwen-main #1" in card
    assert "Drift: the bill and the engine disagree" in card
    assert "The engine exports no token counters" in card


def test_the_admin_api_gives_the_check_per_replica_and_hour(
    served: Deployment, client_for: Callable, root: Any, alice: Any
) -> None:
    url = "/api/v1/deployments/qwen-main/bill-check/"
    answer = client_for(root).get(url, {"hours": 2})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    first, second = body["replicas"]
    assert first["status"] == "drift" and first["tokens"]["drift"]["prompt"] == 200
    assert first["tokens"]["engine"]["prompt"] == 51_900 and first["restarts"] == 1
    assert second["status"] == "no_counters" and second["engine_exports_counters"] is False
    assert [row["drift_prompt"] for row in body["by_hour"]] == [200, 0]
    # One hour: the earlier one drops out of the window.
    assert client_for(root).get(url, {"hours": 1}).json()["replicas"][0]["requests"] == 5
    assert client_for(root).get(url, {"hours": "x"}).status_code == 400
    assert client_for(root).get("/api/v1/deployments/nope/bill-check/").status_code == 404
    assert client_for(alice).get(url).status_code == 403  # platform admins only
