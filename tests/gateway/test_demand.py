"""Models on demand through the gateway: a cold model started for the requests that want it.

The gateway is the real gunicorn server; the worker's part (deployments.wake_deployment:
start an engine, mark its replica ready, announce the change) is played by the test itself,
which starts a real simulator process and writes the rows the worker would write, as
tests/gateway/test_adapters.py does for adapter loads.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from decimal import Decimal

import httpx
import pytest
from django.conf import settings as django_settings

from core.changes import publish_change
from core.keyspace import demand_failed_key, demand_used_key, demand_wake_key, usage_stream
from core.redis import get_redis
from core.usage import UsageRecord
from deployments import services as deployment_services
from deployments.choices import DeploymentMode, ReplicaState, Visibility
from deployments.models import CatalogModel, Deployment, Node, Replica
from metering import ingest
from metering import services as metering_services
from metering.models import UsageEvent
from metering.serializers import UsageEventSerializer
from tenants.models import Tenant
from tests.engine_sim.conftest import FAST, Sim, start_sim  # noqa: F401
from tests.gateway.conftest import (  # noqa: F401
    METRICS_TOKEN,
    ROOT,
    World,
    engines,
    gateway_url,
    make_model,
    redis_namespace,
    start_gateway,
    stop,
    wait_until_served,
    world,
)
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
QUEUE = f"demand-{secrets.token_hex(4)}"  # its start requests' queue: no worker's but ours
LOG = ROOT / ".pytest-gateway-demand.log"


@pytest.fixture(scope="module")
def demand_gateway(gateway_url: str) -> Iterator[str]:  # noqa: F811
    """A gateway whose start requests go to a queue of this module's own."""
    env = {"TOLLGATE_DEMAND_QUEUE": QUEUE}
    # The broker queued_starts() reads (tests/batches/conftest.py may put another Redis
    # database in this process's environment when the whole suite is collected).
    env["CELERY_BROKER_URL"] = django_settings.REDIS_URL
    proc, url = start_gateway(2, env, log=LOG)
    yield url
    stop(proc)


@dataclass
class Cold:
    """An on-demand model with no engine running, and how to play the worker for it."""

    world: World
    model: CatalogModel
    deployment: Deployment

    @property
    def name(self) -> str:
        return self.model.served_name


@pytest.fixture
def cold(world: World, demand_gateway: str) -> Iterator[Callable[..., Cold]]:  # noqa: F811
    """Makes on-demand models (deployed, desired running, asleep: no replica at all)."""
    world = replace(world, url=demand_gateway)
    made: list[Deployment] = []

    def make(start_timeout: int = 60, visibility: str = Visibility.PUBLIC) -> Cold:
        model = make_model(f"od-{secrets.token_hex(3)}", visibility=visibility)
        # start_timeout below the form's minimum of 10 s: the rows are written directly.
        deployment = Deployment.objects.create(
            name=f"{model.served_name}-dep",
            model=model,
            node=Node.objects.get(name="sim-node"),
            image="tollgate/engine-sim:latest",
            engine_args={"max-num-seqs": 64},
            desired_state="running",
            mode=DeploymentMode.ON_DEMAND,
            start_timeout_seconds=start_timeout,
            state="stopped",
        )
        made.append(deployment)
        metering_services.set_price(None, model, Decimal("1"), Decimal("0.5"), Decimal("2"))
        publish_change("deployment", deployment.pk)
        if visibility == Visibility.PUBLIC:
            wait_until_served(world.url, world.key_a, model.served_name)
        return Cold(world, model, deployment)

    yield make
    r = get_redis()
    r.delete(QUEUE, f"_kombu.binding.{QUEUE}")
    for deployment in made:
        r.delete(demand_wake_key(deployment.pk), demand_failed_key(deployment.pk))
        r.zrem(demand_used_key(), str(deployment.pk))


def as_worker(cold: Cold, start_sim: Callable[..., Sim], *args: str) -> Sim:  # noqa: F811
    """What the worker does on the start the gateway asked for: the engine runs, its
    replica is ready, the gateway is told, and the start is no longer under way."""
    sim = start_sim(
        "sim/od",
        "--served-model-name",
        cold.name,
        *FAST,
        "--sim-output-tokens-min",
        "8",
        "--sim-output-tokens-max",
        "8",
        *args,
    )
    Deployment.objects.filter(pk=cold.deployment.pk).update(awake=True, state="ready")
    Replica.objects.create(
        deployment=cold.deployment,
        index=0,
        node=cold.deployment.node,
        host="127.0.0.1",
        port=sim.port,
        state=ReplicaState.READY,
        healthy=True,
    )
    publish_change("deployment", cold.deployment.pk)
    get_redis().delete(demand_wake_key(cold.deployment.pk))
    return sim


def metric(world: World, name: str, model: str, extra: str = "") -> float:
    """The gateway's ``name`` for ``model`` (summed over its workers)."""
    page = httpx.get(
        f"{world.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    return sum(
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith(name + "{") and f'model="{model}"' in line and extra in line
    )


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}\n{gateway_warnings()}"
        time.sleep(0.05)


def queued_starts() -> list[list[int]]:
    """The arguments of the start tasks waiting on the gateway's demand queue (Celery's
    Redis transport keeps a queue as a list of JSON messages)."""
    found = []
    for raw in get_redis().lrange(QUEUE, 0, -1):
        headers = json.loads(raw)["headers"]
        assert headers["task"] == "deployments.wake_deployment"
        found.append(json.loads(headers["argsrepr"]))
    return found


def gateway_warnings() -> str:
    lines = LOG.read_text(errors="replace").splitlines() if LOG.exists() else []
    return "gateway log:\n" + "\n".join(line for line in lines[-60:] if "UserWarning" not in line)


def chat(world: World, model: str, key: str | None = None, **extra: object) -> httpx.Response:
    return httpx.post(
        f"{world.v1}/chat/completions",
        json={"model": model, "messages": CHAT, "max_tokens": 8, **extra},
        headers={"Authorization": f"Bearer {key or world.key_a}"},
        timeout=120,
    )


def messages(world: World, model: str) -> httpx.Response:
    return httpx.post(
        f"{world.v1}/messages",
        json={"model": model, "messages": CHAT, "max_tokens": 8},
        headers={"x-api-key": world.key_a, "anthropic-version": "2023-06-01"},
        timeout=120,
    )


def in_background(call: Callable[[], httpx.Response], n: int = 1) -> tuple[list, list]:
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(call())) for _ in range(n)]
    for thread in threads:
        thread.start()
    return answers, threads


def events_of(model: CatalogModel) -> list[UsageRecord]:
    records = (UsageRecord.decode(f[b"e"]) for _, f in get_redis().xrange(usage_stream()))
    return [r for r in records if r.model_id == model.pk]


def test_concurrent_requests_start_it_once_wait_and_are_answered_by_its_engine(
    cold: Callable[..., Cold],
    start_sim: Callable[..., Sim],  # noqa: F811
) -> None:
    od = cold()
    world = od.world
    answers, threads = in_background(lambda: chat(world, od.name), 20)
    wait_for(
        lambda: metric(world, "tollgate_demand_waiting_requests", od.name) == 20,
        30,
        "the 20 requests never all waited for the start",
    )
    starts = "tollgate_demand_starts_requested_total"
    wait_for(lambda: metric(world, starts, od.name), 10, "no start was asked for")
    # However many wait, and however often they look again, one start was asked for.
    assert metric(world, starts, od.name) == 1
    assert queued_starts() == [[od.deployment.pk]], gateway_warnings()
    assert get_redis().exists(demand_wake_key(od.deployment.pk))
    sim = as_worker(od, start_sim)
    for thread in threads:
        thread.join(60)
    assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
    for answer in answers:
        reply = answer.json()
        assert reply["model"] == od.name and reply["usage"]["completion_tokens"] == 8
        event = usage_event(answer.headers["x-request-id"])
        assert event.start_wait_ms > 0 and event.completion_tokens == 8
        assert event.deployment_id == od.deployment.pk
    assert metric(world, "tollgate_demand_waits_total", od.name, 'outcome="ready"') == 20
    assert metric(world, starts, od.name) == 1
    assert int(sim.metric("vllm:request_success_total", 'finished_reason="length"')) == 20
    # Stored with it, and shown by the admin API; a warm request waited for nothing.
    entries = [
        (sid, fields)
        for sid, fields in get_redis().xrange(usage_stream())
        if UsageRecord.decode(fields[b"e"]).request_id == answers[0].headers["x-request-id"]
    ]
    ingest.store(entries)
    stored = UsageEvent.objects.get(request_id=answers[0].headers["x-request-id"])
    assert stored.start_wait_ms == usage_event(stored.request_id).start_wait_ms
    assert UsageEventSerializer(stored).data["start_wait_ms"] == stored.start_wait_ms
    warm = chat(world, od.name)
    assert warm.status_code == 200
    assert usage_event(warm.headers["x-request-id"]).start_wait_ms is None


def test_not_started_in_time_a_503_in_each_apis_shape_and_nothing_billed(
    cold: Callable[..., Cold],
) -> None:
    od = cold(start_timeout=3)
    world = od.world
    started = time.monotonic()
    answers, threads = in_background(lambda: chat(world, od.name))
    anthropic, more = in_background(lambda: messages(world, od.name))
    for thread in threads + more:
        thread.join(60)
    assert time.monotonic() - started >= 3
    (answer,), (claude,) = answers, anthropic
    assert answer.status_code == 503 and int(answer.headers["retry-after"]) > 0
    error = answer.json()["error"]
    assert error["code"] == "model_not_ready" and error["type"] == "server_error"
    assert f"The model `{od.name}` is being started on demand" in error["message"]
    assert "within 3 s" in error["message"]
    # Anthropic's "busy, retry later", in its shape.
    assert claude.status_code == 529 and int(claude.headers["retry-after"]) > 0
    body = claude.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "within 3 s" in body["error"]["message"]
    assert metric(world, "tollgate_demand_waits_total", od.name, 'outcome="timeout"') == 2
    # Never forwarded: no usage event at all, let alone tokens.
    time.sleep(0.5)
    assert events_of(od.model) == []


def test_a_failed_start_answers_the_waiting_requests_at_once_with_its_reason(
    cold: Callable[..., Cold],
) -> None:
    od = cold(start_timeout=120)
    world = od.world
    answers, threads = in_background(lambda: chat(world, od.name), 3)
    wait_for(
        lambda: metric(world, "tollgate_demand_waiting_requests", od.name) == 3,
        30,
        "the requests never waited for the start",
    )
    reason = "it needs 40.0 GiB and the node has 12.0 GiB free"
    told = time.monotonic()
    get_redis().set(demand_failed_key(od.deployment.pk), reason, ex=30)
    for thread in threads:
        thread.join(60)
    assert time.monotonic() - told < 10  # a poll's time, not the 120 s start timeout
    for answer in answers:
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert answer.json()["error"]["message"] == (
            f"The model `{od.name}` could not be started on demand: {reason}"
        )
    assert metric(world, "tollgate_demand_waits_total", od.name, 'outcome="failed"') == 3
    # While the reason stands, a new request is told at once too (and asks for no start).
    answer = chat(world, od.name)
    assert answer.status_code == 503 and reason in answer.text
    assert metric(world, "tollgate_demand_starts_requested_total", od.name) == 1
    assert events_of(od.model) == []


def test_its_use_is_recorded_also_while_a_long_stream_runs(
    cold: Callable[..., Cold],
    start_sim: Callable[..., Sim],  # noqa: F811
) -> None:
    od = cold()
    # The engine pauses its streams after 3 tokens until SIGUSR1: a stream as long as needed.
    sim = as_worker(od, start_sim, "--sim-pause-after-tokens", "3")
    world = od.world
    wait_for(lambda: chat(world, od.name).status_code == 200, 30, "never served once warm")
    r, member = get_redis(), str(od.deployment.pk)
    wait_for(lambda: r.zscore(demand_used_key(), member), 10, "its use was never recorded")
    assert abs(r.zscore(demand_used_key(), member) - time.time()) < 10
    opened = time.time()
    with httpx.stream(
        "POST",
        f"{world.v1}/chat/completions",
        json={"model": od.name, "messages": CHAT, "max_tokens": 8, "stream": True},
        headers={"Authorization": f"Bearer {world.key_a}"},
        timeout=60,
    ) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # under way
        wait_for(lambda: r.zscore(demand_used_key(), member) >= opened, 10, "the stream's use")
        first = r.zscore(demand_used_key(), member)
        # No new request: the stream in flight keeps it used, flush after flush.
        wait_for(
            lambda: r.zscore(demand_used_key(), member) > first + 1,
            15,
            "a deployment with a stream in flight was not recorded as used",
        )
        os.kill(sim.proc.pid, signal.SIGUSR1)
        assert any(line == "data: [DONE]" for line in lines)


def test_models_list_shows_its_state_and_hides_others_private_ones(
    cold: Callable[..., Cold],
    start_sim: Callable[..., Sim],  # noqa: F811
) -> None:
    od = cold()
    world = od.world

    def card() -> dict:
        """Its card in the list and on its own (each answered by either gateway process: the
        same once both know what the test just changed)."""
        listed = httpx.get(
            f"{world.v1}/models", headers={"Authorization": f"Bearer {world.key_a}"}, timeout=10
        ).json()["data"]
        one = httpx.get(
            f"{world.v1}/models/{od.name}",
            headers={"Authorization": f"Bearer {world.key_a}"},
            timeout=10,
        ).json()
        cards = {c["id"]: c for c in listed}
        assert "tollgate" not in cards["sim-chat"]
        return one["tollgate"] if cards[od.name] == one else {}

    assert card() == {"mode": "on_demand", "state": "unloaded"}
    get_redis().set(demand_wake_key(od.deployment.pk), 1, ex=60)  # a start under way
    assert card() == {"mode": "on_demand", "state": "loading"}
    as_worker(od, start_sim)
    wait_for(lambda: card().get("state") == "loaded", 30, "never shown as loaded")
    # Tenant A's private on-demand model is, for tenant B, a model that does not exist.
    private = cold(visibility=Visibility.PRIVATE)
    deployment_services.grant_model(None, private.model, world.tenant_a)
    wait_until_served(world.url, world.key_a, private.name)
    seen = [
        (a.status_code, a.text.replace(name, "<m>"))
        for name in (private.name, "od-missing")
        for a in [chat(world, name, key=world.key_b)]
    ]
    assert seen[0] == seen[1] and seen[0][0] == 404, seen
    assert queued_starts() == [], "tenant B's request asked for a start"


def test_waiting_for_a_start_holds_none_of_the_tenants_concurrency(
    cold: Callable[..., Cold],
    start_sim: Callable[..., Sim],  # noqa: F811
) -> None:
    """Tenant A may run one request at a time: three of its requests wait for a cold model,
    and meanwhile its request to a warm model is served (a wait holds no running slot)."""
    od = cold()
    world = od.world
    Tenant.objects.filter(pk=world.tenant_a.pk).update(max_concurrent_requests=1)
    publish_change("tenant", world.tenant_a.pk)
    wait_for(
        lambda: [chat(world, "sim-chat").status_code for _ in range(2)] == [200, 200],
        30,
        "the gateway never learnt the tenant's new limit",
    )
    answers, threads = in_background(lambda: chat(world, od.name), 3)
    wait_for(
        lambda: metric(world, "tollgate_demand_waiting_requests", od.name) == 3,
        30,
        "the 3 requests never all waited for the start",
    )
    warm = chat(world, "sim-chat")
    assert warm.status_code == 200, warm.text  # not 429: nobody of A's holds a running slot
    as_worker(od, start_sim)
    for thread in threads:
        thread.join(60)
    # Started, they run under the tenant's limit as any request: one at a time.
    statuses = sorted(a.status_code for a in answers)
    assert statuses[0] == 200 and set(statuses) <= {200, 429}, [a.text for a in answers]
