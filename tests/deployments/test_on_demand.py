"""On-demand deployments on the real local Docker Engine (simulator engines): started when
asked for, within the node's memory budget, the least recently used idle one put to sleep to
make room, never more engines than the budget holds, idle ones stopped, and a model that can
never fit refused with nothing started.

The gateway's part (asking for a start, recording uses) is played by the test through the
same Redis keys (tests/gateway/test_demand.py runs the gateway itself); queued tasks run
inline (``eager_tasks``), as a worker would run them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError

from core.keyspace import demand_failed_key, demand_stats_key, demand_used_key, demand_wake_key
from core.redis import get_redis
from deployments import demand, lifecycle, placement, services, tasks
from deployments.choices import DeploymentState, OperationKind, OperationStatus, ReplicaState
from deployments.models import CatalogModel, Deployment, Node, Operation, Replica
from deployments.operations import EngineFailed
from tests.deployments.conftest import SIM_IMAGE, sim_env
from tests.deployments.test_docker import containers

pytestmark = [pytest.mark.docker, pytest.mark.django_db(transaction=True)]
ARGS = {"max-num-seqs": 4, "max-model-len": 4096}


def model(name: str, billions: str = "0.6") -> CatalogModel:
    return services.create_model(
        None,
        served_name=name,
        source=f"org/{name}",
        params_billions=Decimal(billions),
        context_length=4096,
    )


def on_demand(node: Node, name: str, **fields: object) -> Deployment:
    return services.create_deployment(
        None,
        name=name,
        model=model(name),
        node=node,
        image=SIM_IMAGE,
        env=sim_env(),
        engine_args=ARGS,
        mode="on_demand",
        idle_timeout_seconds=60,
        **fields,
    )


def used(deployment: Deployment, seconds_ago: float) -> None:
    """What the gateway records when a request uses the deployment."""
    get_redis().zadd(demand_used_key(), {str(deployment.pk): time.time() - seconds_ago})


def ask(deployment: Deployment) -> None:
    """What the gateway does for a request that finds no engine: mark, then queue the task."""
    get_redis().set(demand_wake_key(deployment.pk), 1, nx=True, ex=60)
    tasks.wake_deployment(deployment.pk)


def running(stack: str) -> set[str]:
    return {c.labels["tollgate.deployment"] for c in containers(stack) if c.status == "running"}


@pytest.fixture
def budget_of_two(docker_node: Node) -> Node:
    """The node gives engines room for two of this test's (equal) models, not three."""
    probe = Deployment(name="probe", model=model("probe"), node=docker_node, engine_args=ARGS)
    one = placement.rank_bytes(probe, docker_node)
    probe.model.delete()
    return services.update_node(None, docker_node, memory_limit_bytes=int(one * 2.5))


@pytest.fixture
def most_running(stack: str) -> Iterator[list[int]]:
    """The most engines of the stack seen running at once, sampled while the test runs."""
    seen, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            seen[0] = max(seen[0], len(running(stack)))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    yield seen
    stop.set()
    thread.join(5)


def test_three_models_on_a_budget_of_two_take_turns_least_recently_used_first(
    budget_of_two: Node, stack: str, eager_tasks: None, most_running: list[int]
) -> None:
    a, b, c = (on_demand(budget_of_two, name) for name in ("od-a", "od-b", "od-c"))
    assert running(stack) == set() and demand.demand_state(a) == "unloaded"

    ask(a)
    ask(b)
    assert running(stack) == {str(a.pk), str(b.pk)}
    for d in (a, b):
        d.refresh_from_db()
        assert (d.awake, d.state, demand.demand_state(d)) == (True, "ready", "loaded")
    used(a, 100)  # a was used longest ago
    used(b, 50)

    ask(c)  # no room for a third: a goes
    assert running(stack) == {str(b.pk), str(c.pk)}
    a.refresh_from_db()
    assert (a.awake, a.state, demand.demand_state(a)) == (False, "stopped", "unloaded")
    used(c, 20)

    ask(a)  # b is now the least recently used
    assert running(stack) == {str(a.pk), str(c.pk)}
    assert most_running[0] <= 2
    stats = get_redis().hgetall(demand_stats_key())
    assert int(stats[b"evictions:od-a"]) == 1 and int(stats[b"evictions:od-b"]) == 1
    assert int(stats[b"starts:od-a"]) == 2
    wakes = Operation.objects.filter(kind=OperationKind.WAKE)
    assert wakes.count() == 4 and set(wakes.values_list("status", flat=True)) == {
        OperationStatus.SUCCEEDED
    }
    # Each start, once done, lets the next request ask again.
    assert not get_redis().exists(*(demand_wake_key(d.pk) for d in (a, b, c)))


def test_a_start_asked_for_again_while_awake_starts_nothing_more(
    budget_of_two: Node, stack: str, eager_tasks: None
) -> None:
    a = on_demand(budget_of_two, "od-a")
    ask(a)
    for _ in range(3):  # requests that asked again, or a task delivered twice
        tasks.wake_deployment(a.pk)
    assert Operation.objects.filter(kind=OperationKind.WAKE).count() == 1
    assert len(containers(stack)) == 1


def test_models_in_use_are_not_evicted_and_the_start_is_refused_saying_why(
    budget_of_two: Node, stack: str, eager_tasks: None
) -> None:
    a, b, c = (on_demand(budget_of_two, name) for name in ("od-a", "od-b", "od-c"))
    ask(a)
    ask(b)
    used(a, 1)  # both answered a request a moment ago
    used(b, 2)
    ask(c)
    reason = get_redis().get(demand_failed_key(c.pk)).decode()
    assert "Retry once one of them is idle" in reason and "od-c needs" in reason
    assert running(stack) == {str(a.pk), str(b.pk)}
    c.refresh_from_db()
    assert not c.awake and c.state_message == reason


def test_a_model_that_can_never_fit_is_refused_and_nothing_starts(
    budget_of_two: Node, stack: str, eager_tasks: None
) -> None:
    with pytest.raises(ValidationError) as refused:
        services.create_deployment(
            None,
            name="huge",
            model=model("huge", billions="70"),
            node=budget_of_two,
            image=SIM_IMAGE,
            env=sim_env(),
            engine_args=ARGS,
            mode="on_demand",
        )
    assert "memory" in refused.value.message_dict
    # One that fitted when it was made, until an always-running deployment took the room.
    a = on_demand(budget_of_two, "od-a")
    always = services.create_deployment(
        None,
        name="always",
        model=model("always"),
        node=budget_of_two,
        image=SIM_IMAGE,
        env=sim_env(),
        engine_args={**ARGS, "max-model-len": 4096},
        replicas=2,
    )
    assert Deployment.objects.get(pk=always.pk).state == DeploymentState.READY
    ask(a)
    reason = get_redis().get(demand_failed_key(a.pk)).decode()
    assert "it can never fit there" in reason
    assert running(stack) == {str(always.pk)}  # the always-running one, never evicted


def test_an_idle_model_is_stopped_and_a_used_one_is_not(
    budget_of_two: Node, stack: str, eager_tasks: None
) -> None:
    a, b = on_demand(budget_of_two, "od-a"), on_demand(budget_of_two, "od-b")
    ask(a)
    ask(b)
    used(a, 61)  # past its 60 s idle timeout
    used(b, 5)
    assert demand.sleep_idle() == 1
    assert running(stack) == {str(b.pk)}
    a.refresh_from_db()
    assert (a.awake, a.state) == (False, "stopped") and a.last_used_at is not None
    # Asleep, it is still a deployment of its model: the next request starts it again.
    ask(a)
    assert running(stack) == {str(a.pk), str(b.pk)}


def test_a_start_waits_until_evicted_engines_on_its_node_let_go_of_memory(
    budget_of_two: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a start reconcile queued on its own (its worker died after the decision) never
    runs beside an engine put to sleep that still holds memory."""
    asleep = on_demand(budget_of_two, "od-a")
    replica = Replica.objects.create(
        deployment=asleep, index=0, node=budget_of_two, state=ReplicaState.READY
    )
    waking = on_demand(budget_of_two, "od-b")
    op = Operation.objects.create(kind=OperationKind.WAKE, deployment=waking, node=budget_of_two)
    monkeypatch.setattr(lifecycle, "EVICTION_WAIT_SECONDS", 0.5)
    with pytest.raises(EngineFailed, match="did not stop within"):
        lifecycle.wait_for_evictions(op, budget_of_two)
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STOPPED)
    lifecycle.wait_for_evictions(op, budget_of_two)  # nothing holds memory: no wait
