"""The routing table survives the gateway's reloads of its snapshot: a replica that stays as
it was keeps its in-flight count, and the requests in flight on it bring that count back down
when they end (a reload every few seconds under load must not let counts creep upward and
send new requests away from a replica that is in fact idle)."""

import pytest

from deployments.models import Deployment, Node
from gateway.state import load_snapshot
from tests.gateway.conftest import deploy, make_model

pytestmark = pytest.mark.django_db


def test_in_flight_counts_come_back_down_across_reloads() -> None:
    model = make_model("steady")
    node = Node.objects.create(name="n1", docker_url="unix:///x", queue="node.n1")
    deployment = deploy(model, node, 18001, 18002, max_num_seqs=4)
    first = load_snapshot()
    busy = first.routes[model.pk][0]
    busy.outstanding += 3  # three requests in flight on it
    second = load_snapshot(first)
    assert [u.outstanding for u in second.routes[model.pk]] == [3, 0]
    busy.outstanding -= 3  # they end (on the object they were sent with)
    assert [u.outstanding for u in second.routes[model.pk]] == [0, 0]

    # A replica whose engine changed is a new route: it starts from nothing.
    second.routes[model.pk][1].outstanding += 2
    Deployment.objects.filter(pk=deployment.pk).update(engine_args={"max-num-seqs": 8})
    third = load_snapshot(second)
    assert [(u.max_num_seqs, u.outstanding) for u in third.routes[model.pk]] == [(8, 0), (8, 0)]
