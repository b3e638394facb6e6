"""The real engine in Tollgate's lifecycle, and billing to the token.

One deployment of the real vLLM (``tollgate/vllm-cpu``, the tiny test model) lives through
the whole scenario, because each engine start costs about a minute on two cores:

1. the node's Celery worker (a subprocess on the node's queue) deploys it through the
   Docker API policy: health → /v1/models → warm-up → ready, each phase recorded;
2. ``deployments.scrape_engines`` stores its real /metrics figures in Redis; its log is
   read through the admin API;
3. through the real gateway, every answer of the ``openai`` and ``anthropic`` SDKs equals
   the engine's own answer to the same request;
4. a mixed workload of two tenants (cut streams, 429s, a Batch job) is billed exactly the
   tokens vLLM's own counters say it prefilled and generated, once Tollgate's warm-up (which
   its deploy operation records) and the test's own direct requests are accounted for,
   with one exception, measured and bounded: the tokens an engine generates for a cut
   stream between the client's hang-up and its abort reaching the engine are never
   delivered, so never billed (Tollgate bills what it handed to the client). No engine API
   tells how many an aborted request had; the test learns it by running each cut stream
   alone on the idle engine and reading the counters before and after;
5. ``docker kill``: reconcile restarts it; stop leaves no container of the stack.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal

import anthropic
import docker
import httpx
import openai
import pytest
from django.contrib.auth.models import AbstractBaseUser

from deployments import fleet, runtime, services, tasks
from deployments.choices import OperationKind, OperationStatus, ReplicaState
from deployments.models import Deployment, EngineProfile, Node, Operation, Replica
from deployments.profiles import ensure_builtin_profiles
from metering import services as metering_services
from metering.choices import UsageStatus
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.gateway.conftest import start_gateway, stop, wait_until_served
from tests.scaleout.conftest import stop_worker
from tests.vllm import answers, workload
from tests.vllm.conftest import CONTEXT, SERVED_NAME, mark_staged, wait_until
from tests.vllm.stack import (
    GATEWAY_LOG,
    Direct,
    batch_queue,
    billed,
    counters,
    drive,
    idle,
    ingest_until,
    metrics_text,
    ready_replica,
    start_worker,
)

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]
NAME = "tiny"
SLUGS = {"a": "acme", "b": "bravo"}  # tests/conftest.py's tenant_a and tenant_b
START = 600.0  # seconds: a cold start is ~1 min on two cores, several on a loaded machine


@dataclass
class Appliance:
    """The processes of one box and the people using it."""

    url: str
    node: Node
    deployment: Deployment
    worker: subprocess.Popen
    key_a: str
    key_b: str
    key_limited: str  # tenant A's, 2 requests a minute
    admin_token: str
    stack: str

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0)


def containers(stack: str) -> list:
    return docker.from_env().containers.list(
        all=True, filters={"label": f"{runtime.LABEL_STACK}={stack}"}, ignore_removed=True
    )


def deploy(node: Node, model: object) -> Deployment:
    """The built-in ``cpu`` profile with the test model's context and a small KV cache."""
    ensure_builtin_profiles()
    mark_staged(model, node)
    return services.create_deployment(
        None,
        name=NAME,
        model=model,
        node=node,
        profile=EngineProfile.objects.get(name="cpu"),
        engine_args={"max-model-len": CONTEXT},
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )


@pytest.fixture
def appliance(
    vllm_stack: str,
    docker_node: Node,
    tiny_llama: object,
    tenant_a: Tenant,
    tenant_b: Tenant,
    root: AbstractBaseUser,
    redis_namespace: str,
    settings: object,
) -> Iterator[Appliance]:
    settings.TOLLGATE_ENGINE_POLL_SECONDS = 0.5
    extra = {
        "TOLLGATE_REDIS_PREFIX": redis_namespace,
        "TOLLGATE_BATCH_QUEUE": batch_queue(vllm_stack),
    }
    gateway, url = start_gateway(2, extra, log=GATEWAY_LOG)
    worker = start_worker(docker_node, vllm_stack, url)
    try:
        metering_services.set_price(None, tiny_llama, Decimal("1"), Decimal("0.5"), Decimal("2"))
        key_a = tenant_services.issue_api_key(None, tenant_a, name="a").plaintext
        key_b = tenant_services.issue_api_key(None, tenant_b, name="b").plaintext
        limited = tenant_services.issue_api_key(None, tenant_a, name="tight", requests_per_minute=2)
        token = tenant_services.issue_admin_token(root, name="ops").plaintext
        drive(lambda: Node.objects.get(pk=docker_node.pk).last_seen_at, 60)
        deployment = deploy(docker_node, tiny_llama)
        yield Appliance(
            url, docker_node, deployment, worker, key_a, key_b, limited.plaintext, token, vllm_stack
        )
    finally:
        stop_worker(worker)
        stop(gateway)


# --- 1. Deploy ------------------------------------------------------------------------------


def check_deployed(app: Appliance) -> Replica:
    """The worker's deploy operation went through every phase; the replica is routed."""

    def deployed() -> Operation | None:
        """the deploy operation to end"""
        op = Operation.objects.get(deployment=app.deployment, kind=OperationKind.DEPLOY)
        return op if op.status in (OperationStatus.SUCCEEDED, OperationStatus.FAILED) else None

    op = drive(deployed, START, every=2.0)
    assert op.status == OperationStatus.SUCCEEDED, f"{op.message}\n{op.error}"
    phases = op.detail["replicas"]["0"]["phases"]
    assert {"pull", "create", "start", "load", "models", "warmup", "total"} <= phases.keys()
    assert phases["load"] > 1.0  # vLLM really loaded: nothing listens before
    replica = Replica.objects.get(deployment=app.deployment)
    # A first start is not a restart (it counted as one: started_at was read after run() set it).
    assert (replica.state, replica.healthy, replica.restart_count) == (ReplicaState.READY, True, 0)
    (container,) = containers(app.stack)
    assert container.image.tags == ["tollgate/vllm-cpu:0.32.0"]
    # The cpu profile leaves half a core of the node (its heartbeat said how many) to the
    # appliance: 1.5 of two cores (docs/getting-started/cpu-engine.md).
    cores = Node.objects.get(pk=app.node.pk).cpu_count
    limit = round((cores - 0.5) * 1e9) if cores >= 1.5 else 0
    assert (container.attrs["HostConfig"]["NanoCpus"] or 0) == limit
    wait_until_served(app.url, app.key_a, SERVED_NAME, timeout=30)
    return replica


# --- 2. Telemetry and logs ------------------------------------------------------------------


def scraped(replica: Replica) -> dict:
    tasks.scrape_engines()  # what beat runs every 5 s
    return fleet.read_telemetry(replica.pk) or {}


def cache_capacity(base_url: str) -> int:
    """num_gpu_blocks × block_size from vLLM's own vllm:cache_config_info labels."""
    line = next(
        x for x in metrics_text(base_url).splitlines() if x.startswith("vllm:cache_config_info{")
    )
    labels = dict(
        part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
    )
    return int(labels["num_gpu_blocks"].strip('"')) * int(labels["block_size"].strip('"'))


def check_telemetry(app: Appliance, replica: Replica, tally: workload.Tally) -> None:
    """While a stream runs the scraped figures show it; idle, they equal vLLM's counters."""
    gw, told, failed = app.openai(app.key_a), [], []
    seen = threading.Event()

    def stream_until_seen() -> None:
        # Greedy and long (~5 s on two cores), and again until a scrape has seen one: the
        # CPU engine sometimes decodes a whole reply between two scrapes the engine starves.
        body = answers.chat_body(max_tokens=workload.LONG, stream_options={"include_usage": True})
        try:
            while not seen.is_set():
                chunks = list(gw.chat.completions.create(**body, stream=True))
                assert len(chunks) > 2 and chunks[-1].usage, "a whole stream with its usage"
                told.append(chunks[-1].usage)
        except Exception as error:  # noqa: BLE001 - reported by the test's own thread below
            failed.append(error)

    def running() -> dict | None:
        assert not failed, failed
        figures = scraped(replica)
        return figures if figures.get("running") == 1 else None

    reader = threading.Thread(target=stream_until_seen)
    reader.start()
    try:
        busy = wait_until(running, 60, "the scraped figures to show the running request")
    finally:
        seen.set()
        reader.join(60)
    assert told and not failed and not reader.is_alive()
    for usage in told:  # each a whole stream: billed what its client was told
        tally.events += 1
        tally.add("a", usage.prompt_tokens, usage.completion_tokens)
    assert busy["waiting"] == 0 and 0 < busy["kv_cache_usage"] <= 1
    assert busy["kv_capacity_tokens"] == cache_capacity(replica.base_url)
    wait_until(lambda: idle(replica.base_url), 60, "the engine to be idle")
    figures = scraped(replica)
    assert (figures["running"], figures["waiting"], figures["kv_cache_usage"]) == (0, 0, 0)
    prompt, generated = counters(replica.base_url)
    assert (figures["prompt_tokens_total"], figures["generation_tokens_total"]) == (
        prompt,
        generated,
    )


def check_logs(app: Appliance) -> None:
    """The engine's own log through the admin API (published by the node's worker)."""

    def logged() -> str:
        """the engine's log on the admin API"""
        answer = httpx.get(
            f"{app.url}/api/v1/deployments/{NAME}/logs/?replica=0&lines=400",
            headers={"Authorization": f"Bearer {app.admin_token}"},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["log"] if "Application startup complete" in answer.text else ""

    log = drive(logged, 30)
    assert "POST /v1/chat/completions HTTP/1.1" in log  # the requests it served


# --- 5. Restart and stop --------------------------------------------------------------------


def check_restart_after_kill(app: Appliance, replica: Replica) -> Replica:
    (container,) = containers(app.stack)
    container.kill()

    def restarted() -> Replica | None:
        """the killed replica to be restarted and ready"""
        again = ready_replica(NAME)
        return again if again and again.restart_count == 1 else None

    again = drive(restarted, START, every=2.0)
    (new,) = containers(app.stack)
    assert new.id != container.id and new.status == "running"
    op = Operation.objects.get(deployment=app.deployment, kind=OperationKind.RESTART)
    assert op.status == OperationStatus.SUCCEEDED
    # The new engine's warm-up was recorded too (the same request: the same tokens).
    warm = warmup_usage(app.deployment, OperationKind.RESTART)
    assert warm == warmup_usage(app.deployment, OperationKind.DEPLOY) and warm[1] == 1
    wait_until_served(app.url, app.key_a, SERVED_NAME, timeout=30)
    answers.check_chat(app.openai(app.key_a), Direct(again.base_url))  # serves as before
    return again


def check_stop(app: Appliance, replica: Replica) -> None:
    services.set_desired_state(None, app.deployment, "stopped")

    def stopped() -> bool:
        """no container of the stack and the replica stopped"""
        state = Replica.objects.get(pk=replica.pk).state
        return state == ReplicaState.STOPPED and not containers(app.stack)

    drive(stopped, 120, every=1.0)
    answer = app.openai(app.key_a)
    with pytest.raises(openai.APIStatusError) as refused:
        answer.chat.completions.create(model=SERVED_NAME, messages=answers.CHAT, max_tokens=2)
    assert refused.value.status_code in (404, 503)


# --- The scenario ---------------------------------------------------------------------------


def warmup_usage(deployment: Deployment, kind: str) -> tuple[int, int]:
    """The tokens of Tollgate's own warm-up request, as its operation recorded them."""
    op = Operation.objects.filter(deployment=deployment, kind=kind).latest("id")
    warm = op.detail["replicas"]["0"]["warmup_usage"]
    return warm["prompt_tokens"], warm["completion_tokens"]


def test_real_vllm_deployed_served_billed_restarted_and_stopped(appliance: Appliance) -> None:
    app = appliance
    replica = check_deployed(app)
    direct = Direct(replica.base_url)
    tally = workload.Tally()

    check_telemetry(app, replica, tally)
    check_logs(app)

    gw, ac = app.openai(app.key_a), app.anthropic(app.key_a)
    tally.events += answers.check_chat(gw, direct)
    tally.events += answers.check_completions(gw, direct)
    tally.events += answers.check_responses(gw, direct)
    tally.events += answers.check_messages(ac, direct)

    run_workload(app, replica.base_url, tally)
    check_bill(app, replica, direct, tally)

    replica = check_restart_after_kill(app, replica)
    check_stop(app, replica)


def measure_cut(
    base_url: str, tally: workload.Tally, tenant: str, read: int, cut: Callable[..., str], *args
) -> None:
    """One cut stream alone on the idle engine: the counters' growth is its own."""
    wait_until(lambda: idle(base_url), 60, "the engine to be idle")
    before = counters(base_url)
    request_id = cut(*args)
    wait_until(lambda: idle(base_url), 60, "the engine to drop the cut stream")
    after = counters(base_url)
    prompt, generated = after[0] - before[0], after[1] - before[1]
    tally.cuts.append(workload.Cut(tenant, request_id, read, prompt, generated))
    tally.events += 1


def run_workload(app: Appliance, base_url: str, tally: workload.Tally) -> None:
    gw_a, gw_b = app.openai(app.key_a), app.openai(app.key_b)
    ac_a, ac_b = app.anthropic(app.key_a), app.anthropic(app.key_b)
    for after in (1, 3, 7):
        measure_cut(base_url, tally, "a", after, workload.cut_chat, gw_a, after)
        measure_cut(base_url, tally, "b", after, workload.cut_completion, gw_b, after)
        measure_cut(base_url, tally, "a", after, workload.cut_messages, ac_a, after)
    workload.refused_by_rate_limit(app.openai(app.key_limited), tally, "a", allowed=2)
    workload.whole_chat(gw_b, tally, "b", 16)
    workload.whole_messages(ac_b, tally, "b", 16)
    workload.run_batch(gw_a, tally, "a", 3, timeout=120)


def check_cuts(tally: workload.Tally) -> int:
    """Each cut stream paid its whole prompt, as the engine counted it, and at least what
    the client read, at most what the engine generated; returns the tokens generated after
    the client left and never delivered (not billed, by design: see the module docstring)."""
    stored = UsageEvent.objects.in_bulk([c.request_id for c in tally.cuts], field_name="request_id")
    undelivered, closed = 0, 0
    for cut in tally.cuts:
        event = stored[cut.request_id]
        print(
            f"cut {event.endpoint} after {cut.read} read ({event.status}): billed "
            f"{event.prompt_tokens} + {event.completion_tokens}, the engine {cut.prompt} + "
            f"{cut.generated}"
        )
        assert event.tenant.slug == SLUGS[cut.tenant]
        assert event.prompt_tokens == cut.prompt
        assert cut.read <= event.completion_tokens <= cut.generated
        # A starved client may hang up only after the gateway handed it the whole answer
        # (into its socket buffer): then the stream ended as usual, and was billed in full.
        assert event.status == UsageStatus.CLIENT_CLOSED or (
            event.status == UsageStatus.OK and event.completion_tokens == cut.generated
        )
        closed += event.status == UsageStatus.CLIENT_CLOSED
        undelivered += cut.generated - event.completion_tokens
        tally.add(cut.tenant, event.prompt_tokens, event.completion_tokens)
    assert closed, "no stream was cut before its end: the cut path went untested"
    return undelivered


def check_bill(app: Appliance, replica: Replica, direct: Direct, tally: workload.Tally) -> None:
    """Everything the engine prefilled and generated is Tollgate's warm-up, the test's
    direct requests, or billed to a tenant: to the token, but for the tokens cut streams
    generated after the client left (never delivered, so never billed)."""
    wait_until(lambda: idle(replica.base_url), 60, "the engine to be idle")
    engine_prompt, engine_completion = counters(replica.base_url)
    ingest_until(tally.events)
    total = billed(deployment=app.deployment)
    assert total["events"] == tally.events  # one per request taken; none for the 429
    warm_prompt, warm_completion = warmup_usage(app.deployment, OperationKind.DEPLOY)
    undelivered = check_cuts(tally)
    print(
        f"\nvLLM's counters: prompt {engine_prompt}, generation {engine_completion}"
        f"\nTollgate's warm-up: prompt {warm_prompt}, completion {warm_completion}"
        f"\nthe test's direct requests: prompt {direct.prompt_tokens}, "
        f"completion {direct.completion_tokens}"
        f"\nbilled ({total['events']} usage events): prompt {total['prompt']}, "
        f"completion {total['completion']}"
        f"\ngenerated after a client cut its stream, never delivered: {undelivered}"
    )
    assert total["prompt"] + warm_prompt + direct.prompt_tokens == engine_prompt
    assert (
        total["completion"] + undelivered + warm_completion + direct.completion_tokens
        == engine_completion
    )
    # Tenant B pays what its own clients were told (for its cut streams: what check_cuts
    # found right), nothing of tenant A's.
    bravo = billed(tenant__slug="bravo")
    assert [bravo["prompt"], bravo["completion"]] == tally.seen["b"]
