"""Tollgate around the real engine, as an appliance runs it: the node's Celery worker as a
subprocess consuming the node's queue (and this stack's batch queue), the real gunicorn
gateway, the control plane's periodic pass driven from the test, and usage ingestion into
PostgreSQL through metering's own consumer code.

What the tests compare Tollgate against is the engine itself: ``Direct`` sends the same
request straight to the replica's port, and ``counters`` reads vLLM's own token counters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.db.models import Count, Sum

from deployments import tasks
from deployments.models import Node, Replica
from metering import ingest
from metering.models import UsageEvent
from tests.databases import database_url
from tests.gateway.conftest import ROOT
from tests.vllm.conftest import wait_until

WORKER_LOG = ROOT / ".pytest-vllm-worker.log"
GATEWAY_LOG = ROOT / ".pytest-vllm-gateway.log"


def worker_env(stack: str, gateway_url: str) -> dict[str, str]:
    """The node worker's environment: this test's settings, as compose would pass them."""
    names = (
        "TOLLGATE_REDIS_PREFIX",
        "TOLLGATE_STACK_ID",
        "TOLLGATE_MODEL_CACHE_VOLUME",
        "TOLLGATE_COMPILE_CACHE_VOLUME",
        "TOLLGATE_ENGINE_NETWORK",
        "TOLLGATE_PULL_POLICY",
        "TOLLGATE_ENGINE_POLL_SECONDS",
        "TOLLGATE_ENGINE_READY_TIMEOUT",
        "TOLLGATE_WARMUP_TIMEOUT",
        "TOLLGATE_ENGINE_SHM_SIZE",
        "TOLLGATE_RESTART_BACKOFF_SECONDS",
        "TOLLGATE_RESTART_BACKOFF_MAX_SECONDS",
        "TOLLGATE_MAX_CRASHES",
        "TOLLGATE_ORPHAN_GRACE_SECONDS",
        "TOLLGATE_DRAIN_TIMEOUT",
        "TOLLGATE_STOP_GRACE_SECONDS",
    )
    return {
        **os.environ,
        **{name: str(getattr(settings, name)) for name in names},
        "DATABASE_URL": database_url(),
        "TOLLGATE_ENV": "test",
        "TOLLGATE_LOG_LEVEL": "WARNING",
        "TOLLGATE_INTERNAL_URL": gateway_url,
        "TOLLGATE_BATCH_QUEUE": batch_queue(stack),
    }


def batch_queue(stack: str) -> str:
    # This stack's own: no other session's worker takes its batch runs.
    return f"batches.{stack}"


def start_worker(node: Node, stack: str, gateway_url: str) -> subprocess.Popen:
    """``celery worker`` on the node's queue and the batch queue, as on the appliance's box."""
    command = [sys.executable, "-m", "celery", "-A", "config", "worker"]
    command += ["-Q", f"{node.queue},{batch_queue(stack)}", "-n", f"{stack}@%h"]
    command += ["--pool", "threads", "--concurrency", "3", "--loglevel", "WARNING"]
    command += ["--without-heartbeat", "--without-gossip", "--without-mingle"]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=worker_env(stack, gateway_url),
        stdout=subprocess.DEVNULL,
        stderr=open(WORKER_LOG, "a"),  # noqa: SIM115 - the child holds it
    )


def drive(check: Callable[[], object], timeout: float, every: float = 0.5) -> object:
    """Run the control plane's periodic pass (beat's reconcile_all) until ``check`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks.reconcile_all()
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {check.__doc__}")


# --- The engine itself ----------------------------------------------------------------------


@dataclass
class Direct:
    """Requests straight to one replica's port: what the engine answers without Tollgate."""

    base_url: str
    prompt_tokens: int = 0  # what the test itself made the engine prefill and generate
    completion_tokens: int = 0

    def post(self, path: str, body: dict) -> dict:
        answer = httpx.post(self.base_url + path, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        usage = data.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
        return data

    def count(self, path: str, body: dict) -> dict:
        """An answer that generates nothing (tokenize, count_tokens): not in the counters."""
        answer = httpx.post(self.base_url + path, json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()


def metrics_text(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=10).text


def sample_sum(text: str, name: str) -> float:
    """The sum of one metric's samples (over label sets) in Prometheus text."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.partition("{")[0].partition(" ")[0] == name
    ]
    assert values, f"{name} is not on /metrics"
    return sum(values)


def counters(base_url: str) -> tuple[int, int]:
    """vLLM's own (prompt, generation) token counters."""
    text = metrics_text(base_url)
    prompt = sample_sum(text, "vllm:prompt_tokens_total")
    return int(prompt), int(sample_sum(text, "vllm:generation_tokens_total"))


def idle(base_url: str) -> bool:
    """Nothing running or waiting on the engine."""
    text = metrics_text(base_url)
    busy = sample_sum(text, "vllm:num_requests_running")
    return busy + sample_sum(text, "vllm:num_requests_waiting") == 0


# --- Metering -------------------------------------------------------------------------------


def ingest_until(expected_events: int, timeout: float = 60.0) -> None:
    """Run metering's consumer (the appliance's ``usage`` service) until PostgreSQL holds
    ``expected_events`` usage events."""

    def stored() -> bool:
        ingest.drain("tgtest-vllm", 2.0)
        return UsageEvent.objects.count() >= expected_events

    wait_until(stored, timeout, f"{expected_events} usage events in PostgreSQL")


def billed(**filters: object) -> dict[str, int]:
    """Sums of the stored usage events (prompt, completion, events)."""
    sums = UsageEvent.objects.filter(**filters).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), events=Count("id")
    )
    return {name: int(value or 0) for name, value in sums.items()}


def ready_replica(deployment_name: str) -> Replica | None:
    return Replica.objects.filter(
        deployment__name=deployment_name, state="ready", healthy=True
    ).first()
