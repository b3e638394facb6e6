"""Which engine replicas hold which LoRA adapters, and getting one loaded for a request.

A request for an adapter goes to a replica of its base that holds it (then the usual
prefix-aware or least-loaded choice among those). When none does, the gateway asks a worker
to load it into the least-loaded replica (the task ``deployments.load_adapter`` on
``TOLLGATE_DEMAND_QUEUE``; one request per replica and adapter, however many requests
wait) and the request waits, up to
``TOLLGATE_ADAPTER_LOAD_TIMEOUT``, for the worker to say it is there. When every holder is
busy, it is loaded on one more replica meanwhile, while this request goes to a holder.

What each replica holds is the worker's record in Redis (core.keyspace.lora_keys), read
again when the worker announces a change (kind ``lora`` on the invalidation channel), every
``REFRESH_SECONDS`` in case an announcement was lost, and while a request waits. Each use
is recorded (batched, once a second) for the worker's least-recently-used unloading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.exceptions

from core.hot import setting
from core.keyspace import lora_keys, lora_want_key
from gateway import metrics
from gateway.errors import error_body
from gateway.state import ModelInfo, Upstream

log = logging.getLogger("tollgate.gateway")

REFRESH_SECONDS = 10.0
FLUSH_SECONDS = 1.0
LOAD_TASK = "deployments.load_adapter"


class LoraTable:
    """One gateway process's view of the adapters its engines hold."""

    def __init__(self, redis: Any, send_task: Any) -> None:
        self.redis = redis
        self.send_task = send_task  # (task name, args, queue) -> None, blocking (a thread)
        self.held: dict[int, frozenset[int]] = {}  # replica id -> adapter ids
        self.failures: dict[int, dict[int, str]] = {}  # replica id -> adapter id -> reason
        self.used: dict[int, dict[int, float]] = {}  # replica id -> adapter id -> ms, to flush
        # Loads this process asked for and has not seen done: a burst of cold requests for
        # several adapters spreads their loads instead of piling them onto one replica.
        self.pending: dict[int, set[int]] = {}
        self._changed = asyncio.Event()

    # --- what replicas hold ------------------------------------------------------------------

    def holders(self, adapter_id: int, upstreams: list[Upstream]) -> list[Upstream]:
        return [u for u in upstreams if adapter_id in self.held.get(u.replica_id, ())]

    async def refresh(self, replica_ids: list[int]) -> None:
        """Read what these replicas hold (and why loads failed) from the worker's record."""
        if not replica_ids:
            return
        async with asyncio.timeout(2.0):
            pipe = self.redis.pipeline(transaction=False)
            for rid in replica_ids:
                held, _used, err = lora_keys(rid)
                pipe.hkeys(held)
                pipe.hgetall(err)
            answers = await pipe.execute()
        for rid, keys, errs in zip(replica_ids, answers[::2], answers[1::2], strict=True):
            self.held[rid] = frozenset(int(k) for k in keys)
            self.failures[rid] = {int(k): v.decode() for k, v in errs.items()}
            self.pending.get(rid, set()).difference_update(self.held[rid], self.failures[rid])
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def keep_fresh(self, routes: Any) -> None:
        """Background task: re-read every replica serving adapters now and then, and flush
        the uses recorded since the last round."""
        last = 0.0
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                await self.flush_used()
                if time.monotonic() - last >= REFRESH_SECONDS:
                    last = time.monotonic()
                    ids = [
                        u.replica_id for ups in routes().values() for u in ups if u.adapter_slots
                    ]
                    await self.refresh(ids)
            except (redis.exceptions.RedisError, OSError, TimeoutError):
                log.warning("could not read or record engines' adapters; will retry", exc_info=True)

    def forget(self, replica_id: int, adapter_id: int) -> None:
        """The replica's engine said it does not hold the adapter (unloaded meanwhile)."""
        self.held[replica_id] = self.held.get(replica_id, frozenset()) - {adapter_id}

    def touch(self, replica_id: int, adapter_id: int) -> None:
        """A request for the adapter went to the replica (recorded in the next flush)."""
        self.used.setdefault(replica_id, {})[adapter_id] = time.time() * 1000

    async def flush_used(self) -> None:
        if not self.used:
            return
        batch, self.used = self.used, {}
        async with asyncio.timeout(2.0):
            pipe = self.redis.pipeline(transaction=False)
            for rid, uses in batch.items():
                pipe.zadd(lora_keys(rid)[1], uses)
            await pipe.execute()

    # --- getting an adapter loaded -------------------------------------------------------------

    async def ensure(self, model: ModelInfo, upstreams: list[Upstream]) -> list[Upstream] | tuple:
        """The replicas to send a request for ``model`` (an adapter) to, once one holds it;
        or (status, body, headers) when none can in time."""
        serving = [u for u in upstreams if u.adapter_slots]
        if not serving:
            return _refusal(
                503,
                f"The adapter `{model.served_name}` cannot be served now: no engine of its base "
                f"model `{model.parent}` has adapters enabled.",
            )
        if setting("TOLLGATE_ADAPTER_ROUTING") == "ignore":
            # For comparison (bench/adapter_routing_bench.py): the least-loaded replica,
            # wherever the adapter is, loading it there if need be.
            serving = [min(serving, key=_load)]
        adapter = model.adapter_id
        limit = setting("TOLLGATE_ADAPTER_LOAD_TIMEOUT")
        deadline = time.monotonic() + limit
        asked: set[int] = set()
        while True:
            holders = self.holders(adapter, serving)
            if holders:
                if asked:
                    waited = time.monotonic() - (deadline - limit)
                    metrics.ADAPTER_WAIT.labels(model.served_name).observe(waited)
                await self._spread(model, holders, serving)
                return holders
            if not asked:
                target = self._target(serving)
                await self.request_load(model, target)
                asked.add(target.replica_id)
            for rid in asked:
                reason = self.failures.get(rid, {}).get(adapter)
                if reason:
                    return _refusal(
                        503, f"The adapter `{model.served_name}` could not be loaded: {reason}"
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                for rid in asked:  # no longer promised: the load may never come
                    self.pending.get(rid, set()).discard(adapter)
                return _refusal(
                    503,
                    f"The adapter `{model.served_name}` is being loaded into an engine and was "
                    "not ready in time. Please retry shortly.",
                )
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except TimeoutError:
                # The announcement may be lost (or was sent before we listened): read it.
                await self.refresh(sorted(asked))

    async def _spread(
        self, model: ModelInfo, holders: list[Upstream], serving: list[Upstream]
    ) -> None:
        """Every holder busy past the threshold: load it on the least-loaded other replica
        too (this request still goes to a holder)."""
        spread = setting("TOLLGATE_ADAPTER_SPREAD_LOAD")
        if len(holders) == len(serving) or min(map(_load, holders)) < spread:
            return
        # Only into a free place: a copy that unloads another adapter costs that one a load
        # (and its requests a wait) to save this one a queue.
        others = [u for u in serving if u not in holders and self._places(u) > 0]
        if not others:
            return
        target = min(others, key=_load)
        if _load(target) < spread:
            await self.request_load(model, target)

    def _target(self, serving: list[Upstream]) -> Upstream:
        """Where to load an adapter no replica holds: the replica with the most free places
        (counting loads asked for and not yet done: its loading unloads nobody's), then the
        least loaded."""
        return min(serving, key=lambda u: (-self._places(u), _load(u)))

    def _places(self, u: Upstream) -> int:
        """Adapter places of a replica neither held nor promised to a load under way."""
        taken = self.held.get(u.replica_id, frozenset()) | self.pending.get(u.replica_id, set())
        return u.adapter_slots - len(taken)

    async def request_load(self, model: ModelInfo, target: Upstream) -> None:
        """Ask a worker to load the adapter into the replica, once however many ask."""
        adapter = model.adapter_id
        timeout = max(int(setting("TOLLGATE_ADAPTER_LOAD_TIMEOUT")), 1)
        try:
            async with asyncio.timeout(2.0):
                first = await self.redis.set(
                    lora_want_key(target.replica_id, adapter), 1, nx=True, ex=timeout
                )
            self.pending.setdefault(target.replica_id, set()).add(adapter)
            if first:
                metrics.ADAPTER_LOADS.labels(model.served_name).inc()
                args = [adapter, target.replica_id]
                queue = setting("TOLLGATE_DEMAND_QUEUE")
                await asyncio.to_thread(self.send_task, LOAD_TASK, args, queue)
        except Exception:  # noqa: BLE001 - the broker's errors too: the request waits on
            log.warning(
                "could not ask for adapter %s on replica %s",
                adapter,
                target.replica_id,
                exc_info=True,
            )
            # Let the next request ask again instead of waiting out the mark.
            with contextlib.suppress(redis.exceptions.RedisError, OSError, TimeoutError):
                await self.redis.delete(lora_want_key(target.replica_id, adapter))


def _load(u: Upstream) -> float:
    return u.outstanding / max(u.max_num_seqs, 1)


def _refusal(status: int, message: str) -> tuple:
    body = error_body(message, "server_error", code="model_not_ready")
    return status, body, [(b"retry-after", b"5")]
