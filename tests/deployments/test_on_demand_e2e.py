"""Models on demand end to end: the real gateway (gunicorn), a real Celery worker on the
node's queue and the demand queue, the real local Docker Engine behind the Docker API policy
and simulator engine containers. Three on-demand models on a node whose budget holds two:
each asked for in turn answers, the least recently used one is put to sleep each time, never
more than two engines run; 50 concurrent first requests to a cold model start one engine."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal

import httpx
import pytest
from django.conf import settings

from config.celery import app as celery_app
from core.keyspace import demand_stats_key, demand_used_key
from core.redis import get_redis
from deployments import placement, services
from deployments.choices import OperationKind
from deployments.models import CatalogModel, Deployment, Node, Operation
from metering import services as metering_services
from tenants import services as tenant_services
from tests.deployments.conftest import SIM_IMAGE, sim_env
from tests.deployments.test_on_demand import ARGS, running
from tests.gateway.conftest import (  # noqa: F401
    METRICS_TOKEN,
    ROOT,
    redis_namespace,
    start_gateway,
    stop,
    wait_until_served,
)
from tests.vllm.stack import worker_env

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
QUEUE = f"demand-{secrets.token_hex(4)}"
LOG = ROOT / ".pytest-on-demand-worker.log"


@dataclass
class Appliance:
    """The gateway and the node's worker, both on this test's demand queue and broker."""

    url: str
    node: Node
    stack: str
    worker: subprocess.Popen | None = None
    # The broker: this test process's own Celery broker unless given (what the test queues,
    # beat's reconcile pass included, must reach the worker; tests/batches/conftest.py puts
    # another Redis database in the environment subprocesses inherit).
    broker_url: str = ""

    @property
    def broker(self) -> dict[str, str]:
        """The test's Redis (the suite's, or a fault test's own) as store and broker."""
        broker = self.broker_url or celery_app.conf.broker_url
        return {
            "TOLLGATE_DEMAND_QUEUE": QUEUE,
            "CELERY_BROKER_URL": broker,
            "REDIS_URL": settings.REDIS_URL,
        }

    def start_worker(self) -> subprocess.Popen:
        # A model counts as in use (never evicted) for a second after its last request: the
        # test's requests come one after another, each a moment after the last.
        busy = {"TOLLGATE_DEMAND_BUSY_SECONDS": "1"}
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q",
             f"{self.node.queue},{QUEUE}", "-n", f"{self.stack}@%h", "--pool", "threads",
             "--concurrency", "4", "--without-heartbeat", "--without-gossip",
             "--without-mingle", "--loglevel", "WARNING"],
            cwd=ROOT, env={**worker_env(self.stack, ""), **self.broker, **busy},
            stdout=subprocess.DEVNULL, stderr=open(LOG, "a"),  # noqa: SIM115 - the child's
        )  # fmt: skip
        return self.worker

    def worker_alive(self) -> None:
        assert self.worker is not None and self.worker.poll() is None, LOG.read_text()[-3000:]


def run_appliance(node: Node, stack: str, broker_url: str = "") -> Iterator[Appliance]:
    app = Appliance("", node, stack, broker_url=broker_url)
    app.start_worker()
    gateway, app.url = start_gateway(2, app.broker, log=ROOT / ".pytest-on-demand-gateway.log")
    yield app
    stop(gateway)
    if app.worker is not None and app.worker.poll() is None:
        stop(app.worker)
    get_redis().delete(QUEUE)


@pytest.fixture
def appliance(
    docker_node: Node,
    stack: str,
    redis_namespace: str,  # noqa: F811
) -> Iterator[Appliance]:
    yield from run_appliance(docker_node, stack)


def model(name: str) -> CatalogModel:
    created = services.create_model(
        None, served_name=name, source=f"org/{name}", params_billions=Decimal("0.6"),
        context_length=4096,
    )  # fmt: skip
    metering_services.set_price(None, created, Decimal("1"), Decimal("0.5"), Decimal("2"))
    return created


def use_recorded(deployment: Deployment) -> None:
    """Wait until the gateway wrote down a use of the deployment after its last start (it
    writes uses every 2 s): the least recently used is then the one the test means."""
    started = (
        Operation.objects.filter(kind=OperationKind.WAKE, deployment=deployment)
        .latest("created_at")
        .detail["asked"]
    )
    deadline = time.monotonic() + 15
    while (get_redis().zscore(demand_used_key(), str(deployment.pk)) or 0) <= started:
        assert time.monotonic() < deadline, f"the gateway never recorded a use of {deployment}"
        time.sleep(0.1)


def chat(url: str, key: str, name: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def test_on_demand_models_take_turns_within_the_budget_and_one_start_serves_fifty(
    appliance: Appliance, docker_node: Node, stack: str
) -> None:
    url, worker_alive = appliance.url, appliance.worker_alive
    probe = Deployment(name="probe", model=model("probe"), node=docker_node, engine_args=ARGS)
    one = placement.rank_bytes(probe, docker_node)
    services.update_node(None, docker_node, memory_limit_bytes=int(one * 2.5))
    names = ("od-a", "od-b", "od-c")
    deployments = {
        name: services.create_deployment(
            None,
            name=name,
            model=model(name),
            node=docker_node,
            image=SIM_IMAGE,
            env=sim_env(SIM_LOAD_SECONDS="2"),
            engine_args=ARGS,
            mode="on_demand",
            start_timeout_seconds=120,
        )  # fmt: skip
        for name in names
    }
    # Room for the fifty at once (waiting for the start does not count; running does).
    tenant = tenant_services.create_tenant(
        None, name="Acme", slug="acme", max_concurrent_requests=64
    )
    key = tenant_services.issue_api_key(None, tenant, name="on-demand").plaintext
    wait_until_served(url, key, "od-c")

    most, stop_sampling = [0], threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(0.05):
            most[0] = max(most[0], len(running(stack)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # 50 first requests at once to a cold model: all answered, by one engine.
        answers: list[int] = []
        threads = [
            threading.Thread(target=lambda: answers.append(chat(url, key, "od-a").status_code))
            for _ in range(50)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        worker_alive()
        assert answers == [200] * 50
        assert running(stack) == {str(deployments["od-a"].pk)}
        wakes = Operation.objects.filter(kind=OperationKind.WAKE, deployment=deployments["od-a"])
        assert wakes.count() == 1
        use_recorded(deployments["od-a"])
        # Each model in turn: the third start puts the least recently used to sleep.
        for name, awake_after in (
            ("od-b", {"od-a", "od-b"}),
            ("od-c", {"od-b", "od-c"}),  # od-a was used longest ago
            ("od-a", {"od-c", "od-a"}),  # now od-b was
        ):
            time.sleep(1.5)  # past the second the last model used counts as in use
            reply = chat(url, key, name)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == name
            assert running(stack) == {str(deployments[n].pk) for n in awake_after}
            use_recorded(deployments[name])
    finally:
        stop_sampling.set()
        sampler.join(5)
    assert most[0] <= 2
    stats = get_redis().hgetall(demand_stats_key())
    assert int(stats[b"evictions:od-a"]) == 1 and int(stats[b"evictions:od-b"]) == 1
    page = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    asked = [
        float(line.rsplit(" ", 1)[1])
        for line in page.text.splitlines()
        if line.startswith("tollgate_demand_starts_requested_total{") and 'model="od-a"' in line
    ]
    assert sum(asked) == 2  # the fifty's one start, and the one after its eviction
