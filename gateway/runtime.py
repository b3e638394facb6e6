"""The gateway's per-process runtime: cached state, Redis, the upstream HTTP session.

Start-up loads the snapshot; a background task listens on the invalidation channel and
reloads (debounced) within a second of any change; a timer reloads every
``REFRESH_SECONDS`` in case a message was lost; used keys' ``last_used_at`` is written in
batches, never per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis
import redis.exceptions
from django.conf import settings
from django.db import close_old_connections

from core.keyspace import invalidation_channel, preempt_channel, wake_channel
from gateway import metrics
from gateway.admission import Admission
from gateway.demand import DemandTable
from gateway.limiter import Limiter, Reservation
from gateway.lora import LoraTable
from gateway.redispipe import RedisPipe
from gateway.response_store import ResponseStore
from gateway.routing import Router
from gateway.state import ModelInfo, Snapshot, load_snapshot
from gateway.upstream import EngineClient, make_client

log = logging.getLogger("tollgate.gateway")

REFRESH_SECONDS = 30.0
DEBOUNCE_SECONDS = 0.05
LAST_USED_FLUSH_SECONDS = 10.0
SETTLE_RETRY_SECONDS = 1.0
# A request that must not be answered from state loaded before a change (look_again): such
# loads begin at most once a second per process, and none is waited for longer than this.
LOOK_AGAIN_EVERY_SECONDS = 1.0
LOOK_AGAIN_TIMEOUT_SECONDS = 3.0
REDIS_CONNECTIONS = 64
MAX_UNSETTLED = 100_000


def _load_in_thread(previous: Snapshot | None) -> Snapshot:
    close_old_connections()
    try:
        return load_snapshot(previous)
    finally:
        close_old_connections()


def _send_task(name: str, args: list, queue: str) -> None:
    """Queue a worker task by name (the gateway never imports the apps' task modules)."""
    from celery import current_app  # the project's app (config/__init__.py loads it)

    current_app.send_task(name, args=args, queue=queue or None)


def _mark_used(key_ids: set[int]) -> None:
    from django.utils import timezone

    from tenants.models import ApiKey

    close_old_connections()
    try:
        ApiKey.objects.filter(pk__in=key_ids).update(last_used_at=timezone.now())
    finally:
        close_old_connections()


class Runtime:
    """Everything one gateway process shares between requests."""

    def __init__(self) -> None:
        self.max_frame = settings.TOLLGATE_MAX_SSE_FRAME_BYTES  # a relayed SSE event, at most
        self.snapshot = Snapshot()
        self.redis: aioredis.Redis | None = None
        self.pipe: RedisPipe | None = None  # the per-request calls (admit, settle, checkpoint)
        self.limiter: Limiter | None = None
        self.router: Router | None = None
        self.session: EngineClient | aiohttp.ClientSession | None = None
        self.used_keys: set[int] = set()
        self.unsettled: list[tuple[Reservation, int, int, bytes, int]] = []
        self.admission: Admission | None = None
        self.responses: ResponseStore | None = None  # kept /v1/responses answers
        self.lora: LoraTable | None = None  # which engines hold which adapters
        self.demand: DemandTable | None = None  # on-demand starts and uses
        self.open_requests: set[str] = set()  # admitted, not yet settled
        # Preemptible requests of this process (request id -> its forwarding, which
        # on_preempt() stops: gateway/preemptible.py)
        self.preemptible: dict[str, Any] = {}
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()
        self._reload_requested = asyncio.Event()
        self._fresh_load: asyncio.Future | None = None  # look_again's load, shared
        self._fresh_load_at = 0.0

    async def start(self) -> None:
        # For everything but the per-request calls: a bounded pool that queues callers, so a
        # burst waits for a connection instead of opening thousands. No socket_timeout:
        # redis-py would wrap every command in a task of its own; calls carry a timeout.
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            max_connections=REDIS_CONNECTIONS,
            timeout=5,
            socket_connect_timeout=2,
            health_check_interval=30,
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self.pipe = RedisPipe.from_url(settings.REDIS_URL)
        self.limiter = Limiter(self.redis, self.pipe)
        self.router = Router(self.pipe)
        self.admission = Admission(self.redis)
        self.responses = ResponseStore(self.redis, self.pipe)
        self.lora = LoraTable(self.redis, _send_task)
        self.demand = DemandTable(self.redis, _send_task, lambda: self.snapshot)
        self.session = make_client(settings.TOLLGATE_UPSTREAM_CLIENT)
        try:
            self.snapshot = await asyncio.to_thread(_load_in_thread, None)
        except BaseException:
            await self.session.close()
            await self.redis.aclose()
            await self.pipe.aclose()
            raise
        self._tasks = [
            asyncio.create_task(self._listen(), name="gateway-invalidation"),
            asyncio.create_task(self._reloader(), name="gateway-reloader"),
            asyncio.create_task(self._flush_last_used(), name="gateway-last-used"),
            asyncio.create_task(self._retry_unsettled(), name="gateway-settle-retry"),
            asyncio.create_task(self._flush_metrics(), name="gateway-metrics"),
            asyncio.create_task(
                self.lora.keep_fresh(lambda: self.snapshot.routes), name="gateway-adapters"
            ),
            asyncio.create_task(self.demand.keep_recording(), name="gateway-demand"),
            asyncio.create_task(
                self.admission.renew_leases(self.open_requests), name="gateway-leases"
            ),
            asyncio.create_task(
                self.admission.watch_telemetry(
                    lambda: self.snapshot.routes, lambda: self.snapshot.models
                ),
                name="gateway-telemetry",
            ),
        ]
        # Django, the app and the snapshot are loaded: move those ~100k long-lived objects out
        # of the collector's sight, or every full collection (one per ~70k allocations, a
        # few hundred requests) rescans them all - ~40 µs a request, measured.
        gc.collect()
        gc.freeze()
        log.info(
            "gateway ready: %d keys, %d models, %d routed models",
            len(self.snapshot.keys),
            len(self.snapshot.models),
            len(self.snapshot.routes),
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        metrics.flush()
        if self.demand:
            with contextlib.suppress(redis.exceptions.RedisError, OSError, TimeoutError):
                await self.demand.flush_used()
        if self.used_keys:
            await asyncio.to_thread(_mark_used, set(self.used_keys))
        if self.session:
            await self.session.close()
        if self.redis:
            await self.redis.aclose()
        if self.pipe:
            await self.pipe.aclose()

    async def settle(
        self, reservation: Reservation, tokens: int, money_nano: int, event: bytes, model_id: int
    ) -> None:
        """Settle a finished request; if Redis is away, keep it and retry until it is back."""
        self.open_requests.discard(reservation.request_id)
        try:
            await self.limiter.settle(reservation, tokens, money_nano, event, model_id)
        except redis.exceptions.ResponseError:
            # Redis answered with an error: a bug, not an outage. Retrying cannot help.
            log.exception("settling %s failed", reservation.request_id)
            return
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            if len(self.unsettled) >= MAX_UNSETTLED:
                log.error(
                    "dropping usage of %s: %d settlements already waiting for Redis",
                    reservation.request_id,
                    MAX_UNSETTLED,
                )
                return
            self.unsettled.append((reservation, tokens, money_nano, event, model_id))
            log.warning("Redis unreachable: usage of %s kept for retry", reservation.request_id)

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(metrics.FLUSH_SECONDS)
            try:
                metrics.flush()
            except Exception:  # noqa: BLE001 - metrics must never take the gateway down
                log.exception("could not update the gateway's metrics")

    async def _retry_unsettled(self) -> None:
        while True:
            await asyncio.sleep(SETTLE_RETRY_SECONDS)
            while self.unsettled:
                reservation, tokens, money, event, model_id = self.unsettled[0]
                try:
                    # Settling is idempotent per request id, so a lost reply is safe to repeat.
                    await self.limiter.settle(reservation, tokens, money, event, model_id)
                except (redis.exceptions.RedisError, OSError, TimeoutError):
                    break
                self.unsettled.pop(0)

    def request_reload(self) -> None:
        self._reload_requested.set()

    async def reload(self) -> None:
        self.snapshot = await asyncio.to_thread(_load_in_thread, self.snapshot)
        self.demand.snapshot_changed()  # requests waiting for an on-demand start look again

    async def look_again(self, name: str) -> ModelInfo | None:
        """The model ``name`` as the database says now, not as this process last heard: a
        change reaches the gateway's processes a moment after the admin API shows it (the
        invalidation, then a reload), and an answer such as "still being checked" must not
        come from before it. Each caller waits for a load begun after it asked; callers share
        loads, begun at most one a second (a tenant calling an adapter under check must not
        make each request a database read). Should the load fail or take long, the state in
        hand answers."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        try:
            async with asyncio.timeout(LOOK_AGAIN_TIMEOUT_SECONDS):
                while True:
                    load = self._fresh_load
                    if load is not None and (self._fresh_load_at >= asked or not load.done()):
                        await asyncio.shield(load)
                        if self._fresh_load_at >= asked:
                            break
                        continue
                    wait = self._fresh_load_at + LOOK_AGAIN_EVERY_SECONDS - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                        continue
                    self._fresh_load_at = loop.time()
                    self._fresh_load = asyncio.ensure_future(self.reload())
        except Exception:  # noqa: BLE001 - the snapshot in hand still answers
            log.warning("could not load the gateway's state afresh", exc_info=True)
        return self.snapshot.models.get(name)

    async def _reloader(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._reload_requested.wait(), timeout=REFRESH_SECONDS)
                await asyncio.sleep(DEBOUNCE_SECONDS)  # one reload for a burst of changes
            except TimeoutError:
                pass
            self._reload_requested.clear()
            try:
                await self.reload()
            except Exception:  # noqa: BLE001 - keep serving from the last good snapshot
                log.exception("gateway state reload failed; serving the previous snapshot")

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(invalidation_channel(), wake_channel(), preempt_channel())
                self.request_reload()  # changes made while we were not listening
                wake, preempt = wake_channel().encode(), preempt_channel().encode()
                async for message in pubsub.listen():
                    if message["channel"] == wake:
                        self.admission.wake_local(int(message["data"]))
                    elif message["channel"] == preempt:
                        victim = self.preemptible.get(message["data"].decode())
                        if victim is not None:  # else another process serves it
                            victim.on_preempt()
                    elif message["data"].startswith(b'{"kind":"lora"'):
                        replica = int(orjson.loads(message["data"])["id"])
                        task = asyncio.create_task(self._refresh_lora(replica))
                        self._side_tasks.add(task)  # held until done (asyncio keeps weak refs)
                        task.add_done_callback(self._side_tasks.discard)
                    else:
                        self.request_reload()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis restarts; resubscribe
                log.warning("invalidation channel lost; resubscribing", exc_info=True)
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()

    async def _refresh_lora(self, replica_id: int) -> None:
        try:
            await self.lora.refresh([replica_id])
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            log.warning("could not read replica %s's adapters", replica_id, exc_info=True)

    async def _flush_last_used(self) -> None:
        while True:
            await asyncio.sleep(LAST_USED_FLUSH_SECONDS)
            if not self.used_keys:
                continue
            batch, self.used_keys = self.used_keys, set()
            try:
                await asyncio.to_thread(_mark_used, batch)
            except Exception:  # noqa: BLE001 - database down: try again next round
                self.used_keys |= batch
                log.warning("could not record key use; will retry", exc_info=True)
