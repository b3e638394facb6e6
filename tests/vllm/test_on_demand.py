"""A model on demand on the real vLLM, through Tollgate (issue 30).

The tiny test model deployed on demand (cpu profile) with a 10 s idle timeout, run by the
node's worker as on an appliance, the gateway sending its start requests to that worker.
No engine runs until a tenant asks: the first request (the ``openai`` SDK, an ordinary
timeout) waits while the engine starts and gets the engine's answer; its usage record says
how long it waited; unused for its idle timeout (the test plays beat's idle pass), the
engine's container is gone and the model is listed as unloaded, ready to start again.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal

import httpx
import openai
import pytest

from deployments import demand, runtime, services
from deployments.models import CatalogModel, Deployment, EngineProfile, Node
from deployments.profiles import ensure_builtin_profiles
from metering import services as metering_services
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.deployments.test_docker import containers
from tests.gateway.conftest import start_gateway, stop, wait_until_served
from tests.scaleout.conftest import stop_worker
from tests.vllm.conftest import CONTEXT, SERVED_NAME, mark_staged
from tests.vllm.stack import GATEWAY_LOG, batch_queue, drive, ingest_until, start_worker

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]
NAME = "tiny-on-demand"
START = 600  # seconds: a cold start is ~1 min on two cores, several on a loaded machine
IDLE = 10


@dataclass
class OnDemand:
    url: str
    deployment: Deployment
    key: str
    worker: subprocess.Popen


@pytest.fixture
def on_demand(
    vllm_stack: str,
    docker_node: Node,
    tiny_llama: CatalogModel,
    tenant_a: Tenant,
    redis_namespace: str,
    settings: object,
) -> Iterator[OnDemand]:
    settings.TOLLGATE_ENGINE_POLL_SECONDS = 0.5
    extra = {
        "TOLLGATE_REDIS_PREFIX": redis_namespace,
        "TOLLGATE_BATCH_QUEUE": batch_queue(vllm_stack),
        # Start requests to the node's worker below (on an appliance: the control worker).
        "TOLLGATE_DEMAND_QUEUE": docker_node.queue,
    }
    gateway, url = start_gateway(2, extra, log=GATEWAY_LOG)
    worker = start_worker(docker_node, vllm_stack, url)
    try:
        metering_services.set_price(None, tiny_llama, Decimal("1"), Decimal("0.5"), Decimal("2"))
        key = tenant_services.issue_api_key(None, tenant_a, name="a").plaintext
        drive(lambda: Node.objects.get(pk=docker_node.pk).last_seen_at, 60)
        ensure_builtin_profiles()
        mark_staged(tiny_llama, docker_node)
        deployment = services.create_deployment(
            None,
            name=NAME,
            model=tiny_llama,
            node=docker_node,
            profile=EngineProfile.objects.get(name="cpu"),
            engine_args={"max-model-len": CONTEXT},
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            mode="on_demand",
            idle_timeout_seconds=IDLE,
            start_timeout_seconds=START,
        )
        wait_until_served(url, key, SERVED_NAME)
        yield OnDemand(url, deployment, key, worker)
    finally:
        stop_worker(worker)
        stop(gateway)


def card_state(app: OnDemand) -> str:
    card = httpx.get(
        f"{app.url}/v1/models/{SERVED_NAME}",
        headers={"Authorization": f"Bearer {app.key}"},
        timeout=10,
    ).json()
    return card["tollgate"]["state"]


def engines(stack: str) -> list:
    return [c for c in containers(stack) if c.labels.get(runtime.LABEL_ROLE, "engine") == "engine"]


def test_a_cold_model_starts_for_its_first_request_and_goes_after_its_idle_timeout(
    on_demand: OnDemand, vllm_stack: str
) -> None:
    app = on_demand
    assert engines(vllm_stack) == [] and card_state(app) == "unloaded"

    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key=app.key, max_retries=0)
    asked = time.monotonic()
    answer = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=12,
        temperature=0,
        timeout=START,
    )
    waited = time.monotonic() - asked
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    assert answer.model == SERVED_NAME
    (engine,) = engines(vllm_stack)
    assert engine.status == "running" and card_state(app) == "loaded"
    ingest_until(1)
    event = UsageEvent.objects.get()
    # The wait is on its record: most of the seconds the client waited (engine start).
    assert event.start_wait_ms is not None and event.start_wait_ms > 1000
    assert event.start_wait_ms <= waited * 1000
    assert event.completion_tokens == answer.usage.completion_tokens

    # Unused for its idle timeout: stopped by the idle pass (beat's, played here).
    def gone() -> bool:
        """the idle model's engine to be stopped and removed"""
        demand.sleep_idle()
        return not engines(vllm_stack)

    drive(gone, IDLE + 120, every=1.0)
    deployment = Deployment.objects.get(pk=app.deployment.pk)
    assert (deployment.awake, deployment.state) == (False, "stopped")
    assert demand.demand_state(deployment) == "unloaded"
    assert deployment.last_used_at is not None
    drive(lambda: card_state(app) == "unloaded", 30)
