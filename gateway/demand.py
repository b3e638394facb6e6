"""Models on demand: starting a cold deployment for a request, and recording its use.

A request for a model whose only deployment is ``on_demand`` and has no ready replica asks
a worker to start it (the task ``deployments.wake_deployment`` on ``TOLLGATE_DEMAND_QUEUE``;
one start however many requests wait: the marker ``demand_wake_key`` is set NX for the
start timeout) and waits, before admission (waiting holds none of the tenant's concurrency),
until the gateway's snapshot routes the model: every snapshot reload wakes the waiters,
and a 1-s poll re-reads the worker's ``demand_failed_key``, so a refused or failed start is
answered at once instead of after the timeout. Past the deployment's start timeout the
request gets a 503 with ``Retry-After``; it never reached an engine, so nothing is billed.

Each request sent to an on-demand deployment's engine is noted in process and written, with
the deployments this process has requests in flight on, to ``demand_used_key`` every
``FLUSH_SECONDS`` (one ZADD): the worker's idle pass and least-recently-used eviction read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.exceptions

from core.hot import setting
from core.keyspace import demand_failed_key, demand_used_key, demand_wake_key
from gateway import metrics
from gateway.errors import error_body
from gateway.state import DemandInfo, ModelInfo, Snapshot, Upstream

log = logging.getLogger("tollgate.gateway")

FLUSH_SECONDS = 2.0
POLL_SECONDS = 1.0
WAKE_TASK = "deployments.wake_deployment"
RETRY_AFTER_TIMEOUT = b"10"  # the start is likely still under way
RETRY_AFTER_FAILED = b"30"  # the worker's reason is kept this long (demand_failed_key's TTL)
REDIS_ERRORS = (redis.exceptions.RedisError, OSError, TimeoutError)


class DemandTable:
    """One gateway process's side of on-demand deployments: starts asked for, uses noted."""

    def __init__(self, redis: Any, send_task: Any, snapshot: Callable[[], Snapshot]) -> None:
        self.redis = redis
        self.send_task = send_task  # (task name, args, queue) -> None, blocking (a thread)
        self.snapshot = snapshot  # the runtime's current snapshot
        self.used: set[int] = set()  # deployment ids used since the last flush
        self.in_flight: dict[int, int] = {}  # deployment id -> requests at its engines now
        self._changed = asyncio.Event()

    # --- the snapshot changed -------------------------------------------------------------

    def snapshot_changed(self) -> None:
        """The runtime replaced its snapshot: waiting requests look at the new one."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # --- starting a cold deployment ---------------------------------------------------------

    async def ensure(self, model: ModelInfo, info: DemandInfo) -> list[Upstream] | tuple:
        """The ready replicas of ``model`` once its on-demand deployment runs; or (status,
        body, headers) when it failed to start or did not start in time."""
        waiting = metrics.DEMAND_WAITING.labels(model.served_name)
        waiting.inc()
        try:
            return await self._wait(model, info)
        finally:
            waiting.dec()

    async def _wait(self, model: ModelInfo, info: DemandInfo) -> list[Upstream] | tuple:
        name, limit = model.served_name, info.start_timeout
        started = time.monotonic()
        deadline = started + limit
        asked = False
        while True:
            upstreams = self.snapshot().routes.get(model.id)
            if upstreams:
                self._waited(name, "ready", started)
                return upstreams
            reason = await self._failure(info)
            if reason:
                self._waited(name, "failed", started)
                return _refusal(
                    f"The model `{name}` could not be started on demand: {reason}",
                    RETRY_AFTER_FAILED,
                )
            if not asked:
                asked = await self.request_start(model, info)
            left = deadline - time.monotonic()
            if left <= 0:
                self._waited(name, "timeout", started)
                return _refusal(
                    f"The model `{name}` is being started on demand and was not ready within "
                    f"{limit} s. Please retry shortly.",
                    RETRY_AFTER_TIMEOUT,
                )
            # A reload wakes us; the poll covers a reason set without one (and a failed ask).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, POLL_SECONDS))

    async def _failure(self, info: DemandInfo) -> str:
        """Why the worker's last start of the deployment failed ("": none known)."""
        try:
            async with asyncio.timeout(2.0):
                reason = await self.redis.get(demand_failed_key(info.deployment_id))
        except REDIS_ERRORS:
            return ""  # Redis away: wait on (the snapshot still shows a start that succeeds)
        return reason.decode(errors="replace") if reason else ""

    async def request_start(self, model: ModelInfo, info: DemandInfo) -> bool:
        """Ask a worker to start the deployment, once however many ask; whether the start is
        asked for (by this call or an earlier one). On failure the mark goes, so the next
        attempt (this request's next poll, or another request) asks again."""
        marker = demand_wake_key(info.deployment_id)
        try:
            async with asyncio.timeout(2.0):
                first = await self.redis.set(marker, 1, nx=True, ex=max(info.start_timeout, 1))
            if first:
                queue = setting("TOLLGATE_DEMAND_QUEUE")
                await asyncio.to_thread(self.send_task, WAKE_TASK, [info.deployment_id], queue)
                metrics.DEMAND_STARTS.labels(model.served_name).inc()
        except Exception:  # noqa: BLE001 - the broker's errors too: the request waits on
            log.warning(
                "could not ask for a start of deployment %s", info.deployment_id, exc_info=True
            )
            with contextlib.suppress(*REDIS_ERRORS):
                await self.redis.delete(marker)
            return False
        return True

    @staticmethod
    def _waited(name: str, outcome: str, started: float) -> None:
        metrics.DEMAND_WAITS.labels(name, outcome).inc()
        metrics.DEMAND_WAIT.labels(name).observe(time.monotonic() - started)

    # --- what tenants see in /v1/models ------------------------------------------------------

    async def states(self, models: list[ModelInfo]) -> dict[int, str]:
        """Each on-demand model's state, by model id: loaded (a replica is ready), loading
        (a start is under way) or unloaded; one Redis round trip for those not loaded."""
        snap = self.snapshot()
        found: dict[int, str] = {}
        cold: list[tuple[int, int]] = []  # (model id, deployment id)
        for model in models:
            info = snap.demand.get(model.id)
            if info is None or model.id in found:
                continue
            found[model.id] = "loaded" if snap.routes.get(model.id) else "unloaded"
            if found[model.id] == "unloaded":
                cold.append((model.id, info.deployment_id))
        if not cold:
            return found
        try:
            async with asyncio.timeout(2.0):
                pipe = self.redis.pipeline(transaction=False)
                for _, deployment_id in cold:
                    pipe.exists(demand_wake_key(deployment_id))
                marked = await pipe.execute()
        except REDIS_ERRORS:
            log.warning("could not read on-demand starts under way", exc_info=True)
            return found
        for (model_id, _), starting in zip(cold, marked, strict=True):
            if starting:
                found[model_id] = "loading"
        return found

    # --- last use ----------------------------------------------------------------------------

    def begin(self, deployment_id: int) -> None:
        """A request went to an engine of the on-demand deployment (no Redis call here)."""
        self.used.add(deployment_id)
        self.in_flight[deployment_id] = self.in_flight.get(deployment_id, 0) + 1

    def end(self, deployment_id: int) -> None:
        self.used.add(deployment_id)
        left = self.in_flight.get(deployment_id, 0) - 1
        if left > 0:
            self.in_flight[deployment_id] = left
        else:
            self.in_flight.pop(deployment_id, None)

    async def flush_used(self) -> None:
        """Write the uses since the last flush, and the deployments busy now, as used now."""
        batch = self.used | self.in_flight.keys()
        if not batch:
            return
        self.used = set()
        now = time.time()
        try:
            async with asyncio.timeout(2.0):
                await self.redis.zadd(demand_used_key(), {str(d): now for d in batch})
        except BaseException:
            self.used |= batch  # written next round
            raise

    async def keep_recording(self) -> None:
        """Background task: flush the uses every ``FLUSH_SECONDS``."""
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                await self.flush_used()
            except REDIS_ERRORS:
                log.warning(
                    "could not record on-demand deployments' use; will retry", exc_info=True
                )


def _refusal(message: str, retry_after: bytes) -> tuple:
    body = error_body(message, "server_error", code="model_not_ready")
    return 503, body, [(b"retry-after", retry_after)]
