"""Faults during an on-demand start (issue 30): the engine failing to start, the worker
killed in the middle of a start, Redis restarting while requests wait. Every waiting request
gets an answer (the engine's, or a clear error), nothing is billed twice, and no engine is
left running outside the node's budget.

The appliance is the real gateway (gunicorn), a real Celery worker on the node's queue and
the demand queue, the local Docker Engine behind the Docker API policy and simulator
engine containers; the test plays beat (the reconcile pass) where a fault needs it."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest
from django.db import connection
from kombu.exceptions import OperationalError

from core.keyspace import usage_stream
from core.redis import get_redis
from deployments import demand, operations, placement, services, tasks
from deployments.choices import OperationKind, OperationStatus, ReplicaState
from deployments.models import Deployment, Node, Operation, Replica
from tenants import services as tenant_services
from tests.deployments.conftest import SIM_IMAGE, sim_env
from tests.deployments.test_on_demand import ARGS, running
from tests.deployments.test_on_demand_e2e import Appliance, model, run_appliance
from tests.faults.conftest import RedisServer, own_redis, procs  # noqa: F401
from tests.gateway.conftest import redis_namespace, wait_until_served  # noqa: F401

pytestmark = [pytest.mark.faults, pytest.mark.docker, pytest.mark.django_db(transaction=True)]
WAITERS = 5
START_TIMEOUT = 120


@pytest.fixture
def appliance(
    docker_node: Node,
    stack: str,
    redis_namespace: str,  # noqa: F811
) -> Iterator[Appliance]:
    yield from run_appliance(docker_node, stack)


@dataclass
class Waiters:
    """Requests sent at once for a cold model; each one's status and body once answered."""

    url: str
    key: str
    name: str
    answers: list[tuple[int, bytes, str]] = field(default_factory=list)

    def start(self) -> Waiters:
        def ask() -> None:
            try:
                r = httpx.post(
                    f"{self.url}/v1/chat/completions",
                    json={"model": self.name, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {self.key}"},
                    timeout=START_TIMEOUT + 60,
                )  # fmt: skip
                self.answers.append((r.status_code, r.content, r.headers.get("x-request-id", "")))
            except httpx.HTTPError as exc:
                self.answers.append((0, repr(exc).encode(), ""))

        self.threads = [threading.Thread(target=ask, daemon=True) for _ in range(WAITERS)]
        for t in self.threads:
            t.start()
        return self

    def join(self) -> list[tuple[int, bytes, str]]:
        for t in self.threads:
            t.join(START_TIMEOUT + 90)
        assert len(self.answers) == WAITERS, "a waiting request got no answer"
        for status, body, _ in self.answers:
            # The engine's answer, or Tollgate's clear refusal: nothing else.
            assert status in (200, 503), (status, body[:300])
            if status == 503:
                assert orjson.loads(body)["error"]["code"] == "model_not_ready", body
        return self.answers


def cold_model(app: Appliance, name: str, **env: str) -> tuple[Deployment, str]:
    # The module's tests share the gateway's Redis prefix (tests.gateway.conftest): an
    # earlier test's usage events must not count as this one's.
    get_redis().delete(usage_stream())
    one = placement.rank_bytes(
        Deployment(name="probe", model=model(f"{name}-probe"), node=app.node, engine_args=ARGS),
        app.node,
    )
    services.update_node(None, app.node, memory_limit_bytes=int(one * 1.5))  # room for one
    deployment = services.create_deployment(
        None, name=name, model=model(name), node=app.node, image=SIM_IMAGE,
        env=sim_env(**env), engine_args=ARGS, mode="on_demand",
        start_timeout_seconds=START_TIMEOUT,
    )  # fmt: skip
    tenant = tenant_services.create_tenant(None, name="Acme", slug="acme")
    key = tenant_services.issue_api_key(None, tenant, name="faults").plaintext
    wait_until_served(app.url, key, name)
    return deployment, key


@contextlib.contextmanager
def beat() -> Iterator[None]:
    """Beat's reconcile pass every second while the block runs (it takes over a start whose
    worker died, as on the appliance)."""
    stop = threading.Event()

    def run() -> None:
        try:
            while not stop.wait(1.0):
                tasks.reconcile_all()
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def billed_ids() -> list[str]:
    return [
        orjson.loads(fields[b"e"])["request_id"] for _, fields in get_redis().xrange(usage_stream())
    ]


def settle(check: object, timeout: float, what: str) -> None:
    """Run the reconcile pass (beat's, played here) until ``check`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        tasks.reconcile_all()
        time.sleep(0.5)


def no_billing_twice(answers: list[tuple[int, bytes, str]]) -> None:
    ok = {rid for status, _, rid in answers if status == 200}
    settle(lambda: set(billed_ids()) >= ok, 30, "every answered request's usage event")
    ids = billed_ids()
    assert len(ids) == len(set(ids)) and set(ids) == ok


def test_an_engine_that_fails_to_start_answers_every_waiting_request_at_once(
    appliance: Appliance, stack: str
) -> None:
    deployment, key = cold_model(appliance, "od-broken", SIM_LOAD_FAIL_EXIT_CODE="3")
    asked = time.monotonic()
    answers = Waiters(appliance.url, key, "od-broken").start().join()
    assert {status for status, _, _ in answers} == {503}
    assert time.monotonic() - asked < START_TIMEOUT / 2  # told why, not left to time out
    assert "could not be started on demand" in orjson.loads(answers[0][1])["error"]["message"]
    wake = Operation.objects.get(kind=OperationKind.WAKE, deployment=deployment)
    assert wake.status == OperationStatus.FAILED and "exit" in wake.error.lower()
    # Asleep again; reconcile removes what is left of the failed engine.
    settle(lambda: not running(stack), 60, "the failed engine to be gone")
    deployment.refresh_from_db()
    assert not deployment.awake
    no_billing_twice(answers)


def test_a_worker_killed_during_a_start_leaves_no_request_unanswered_nor_engine_twice(
    appliance: Appliance, stack: str
) -> None:
    deployment, key = cold_model(appliance, "od-slow", SIM_LOAD_SECONDS="6")
    waiters = Waiters(appliance.url, key, "od-slow").start()
    settle(
        lambda: Replica.objects.filter(
            deployment=deployment, state__in=[ReplicaState.LOADING, ReplicaState.WARMING]
        ).exists(),
        60,
        "the start to be loading the engine",
    )
    appliance.worker.send_signal(signal.SIGKILL)
    appliance.worker.wait(10)
    appliance.start_worker()  # compose restarts it
    with beat():
        answers = waiters.join()
    settle(lambda: Replica.objects.filter(deployment=deployment, state="ready").exists(),
           120, "the engine ready after the worker came back")  # fmt: skip
    # However the start ended for the waiters, one engine runs, within the budget.
    assert running(stack) == {str(deployment.pk)}
    assert len([c for c in running(stack)]) == 1
    assert Replica.objects.filter(deployment=deployment).count() == 1
    no_billing_twice(answers)
    # And the model answers.
    reply = httpx.post(
        f"{appliance.url}/v1/chat/completions",
        json={"model": "od-slow", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text


@pytest.fixture
def appliance_on_own_redis(
    own_redis: RedisServer,  # noqa: F811
    docker_node: Node,
    stack: str,
    redis_namespace: str,  # noqa: F811
) -> Iterator[tuple[Appliance, RedisServer]]:
    # Its own Redis is the broker too, as on the appliance: it restarts with the rest.
    for app in run_appliance(docker_node, stack, broker_url=own_redis.url):
        yield app, own_redis


def test_redis_restarting_while_requests_wait_for_a_start(
    appliance_on_own_redis: tuple[Appliance, RedisServer], stack: str, settings: object
) -> None:
    """Beat runs through it as on the appliance: if Redis went down the moment the start was
    queued, its task message is lost, and reconcile sends it again (CI1 of 2026-11-28 lost
    it: the waiters timed out and the engine never started)."""
    settings.TOLLGATE_OPERATION_PICKUP_SECONDS = 5.0
    app, redis_server = appliance_on_own_redis
    deployment, key = cold_model(app, "od-redis", SIM_LOAD_SECONDS="4")
    waiters = Waiters(app.url, key, "od-redis").start()
    settle(
        lambda: Operation.objects.filter(kind=OperationKind.WAKE, deployment=deployment).exists(),
        60,
        "the start to be under way",
    )
    redis_server.kill9()
    time.sleep(3)  # Redis down for a few seconds (a restart of its container)
    redis_server.start()
    with beat():
        answers = waiters.join()
    settle(lambda: Replica.objects.filter(deployment=deployment, state="ready").exists(),
           120, "the engine ready")  # fmt: skip
    assert running(stack) == {str(deployment.pk)}
    no_billing_twice(answers)
    assert any(status == 200 for status, _, _ in answers), answers


def test_a_start_whose_task_message_was_lost_is_sent_again_and_answers_the_waiters(
    appliance: Appliance, stack: str, settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the Redis restart above can hit, made certain: the start is decided and
    recorded, but the broker refuses its task (Redis down at that instant). Requests asking
    for the model find a start under way; reconcile (beat) sends the task again after
    TOLLGATE_OPERATION_PICKUP_SECONDS, and every waiting request gets the engine's answer."""
    settings.TOLLGATE_OPERATION_PICKUP_SECONDS = 5.0
    deployment, key = cold_model(appliance, "od-lost", SIM_LOAD_SECONDS="1")

    def refused(*args: object, **kwargs: object) -> None:
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    with monkeypatch.context() as patch:
        patch.setattr(operations, "enqueue", refused)
        demand.request_start(deployment.pk)  # the demand worker's decision, played here
    wake = Operation.objects.get(kind=OperationKind.WAKE, deployment=deployment)
    assert wake.status == OperationStatus.QUEUED
    asked = time.monotonic()
    waiters = Waiters(appliance.url, key, "od-lost").start()
    with beat():
        answers = waiters.join()
    assert [status for status, _, _ in answers] == [200] * WAITERS, answers
    assert time.monotonic() - asked < START_TIMEOUT / 2
    wake.refresh_from_db()
    assert wake.status == OperationStatus.SUCCEEDED
    assert running(stack) == {str(deployment.pk)}
    no_billing_twice(answers)
