"""Admission control: each model's engines get at most a ceiling of concurrent requests;
the rest wait in a priority queue shared by every gateway process (in Redis).

P0 (interactive) goes before P1 (standard) before P2 (batch); inside a class tenants get
weighted fair shares by tokens. P2 takes a slot only while the engines report spare
capacity. Lower classes leave free the slots higher classes recently needed (the headroom,
see acquire.lua), and requests are admitted by predicted tokens as well as by count: each
holds its prompt estimate plus its expected output against the engines' KV cache. A freed
slot is announced on a pub/sub channel, so a waiter in any process can take it at once;
waiters also retry on a short timer, so nothing depends on one message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import redis.asyncio as aioredis
from django.conf import settings

from core.hot import setting
from core.keyspace import (
    engine_metrics_key,
    open_keys,
    pool_keys,
    preempt_channel,
    preempt_verdict_key,
    wait_stats_key,
)
from core.redis import get_redis
from gateway import metrics
from gateway.limiter import SlotRequest, lease_ms

log = logging.getLogger("tollgate.gateway")

RETRY_SECONDS = 0.25
CLASS_INDEX = {"P0": 0, "P1": 1, "P2": 2}
_HERE = Path(__file__).parent
RETRY_LUA = (_HERE / "acquire.lua").read_text() + (_HERE / "retry_slot.lua").read_text()
TELEMETRY_FRESH_SECONDS = 20.0
# acquire.lua ranks a waiter class * CLASS_RANK + its virtual start time. The encoding stays
# between the scripts and this module; others read the queue through ``pool_status``.
CLASS_RANK = 10**13


def headroom_slots(budget: int) -> int:
    """The most slots lower classes leave free for higher ones (0: headroom off; a model
    with one slot has none to keep)."""
    if setting("TOLLGATE_ADMISSION_HEADROOM_SECONDS") <= 0:
        return 0
    return min(int(budget * setting("TOLLGATE_ADMISSION_HEADROOM_MAX_SHARE")), budget - 1)


def queue_timeout(priority: str) -> float:
    return float(setting("TOLLGATE_QUEUE_TIMEOUT_SECONDS")[priority])


def lowered(tenant_class: str, asked: object) -> str:
    """The class for one request: the tenant's, or a lower one the request asks for."""
    if isinstance(asked, bool) or asked is None:
        return tenant_class
    if isinstance(asked, int) and 0 <= asked <= 2:
        asked = f"P{asked}"
    if isinstance(asked, str) and asked.upper() in CLASS_INDEX:
        asked = asked.upper()
        return asked if CLASS_INDEX[asked] > CLASS_INDEX[tenant_class] else tenant_class
    return tenant_class


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """A model's engine pool now, as every gateway process shares it."""

    ceiling: int  # the adaptive concurrency ceiling (the static budget until tuned)
    running: int  # requests holding an engine slot
    waiting: dict[str, int]  # requests queued, by class (P0, P1, P2)


def pool_status(model_id: int, budget: int) -> PoolStatus:
    """The pool of a model whose engines' static budget is ``budget`` (for the console)."""
    running, queue, _, _, ceiling, *_ = pool_keys(model_id)
    pipe = get_redis().pipeline(transaction=False)
    pipe.get(ceiling)
    pipe.zcard(running)
    for index in CLASS_INDEX.values():
        low = index * CLASS_RANK if index else "-inf"
        high = f"({(index + 1) * CLASS_RANK}" if index < len(CLASS_INDEX) - 1 else "+inf"
        pipe.zcount(queue, low, high)
    now_ceiling, now_running, *waiting = pipe.execute()
    return PoolStatus(
        ceiling=int(now_ceiling) if now_ceiling else budget,
        running=now_running,
        waiting=dict(zip(CLASS_INDEX, waiting, strict=True)),
    )


@dataclass(frozen=True, slots=True)
class WaitStat:
    """How long one tenant's requests of one class waited for an engine slot."""

    priority: str
    tenant_id: int
    count: int
    seconds: float  # all their waits added up

    @property
    def mean(self) -> float:
        return self.seconds / self.count if self.count else 0.0


def wait_stats(hours: int = 2, now: float | None = None) -> list[WaitStat]:
    """Queue waits by class and tenant over the last ``hours`` UTC hours (this one included)."""
    hour = int((time.time() if now is None else now) // 3600)
    client = get_redis()
    totals: dict[tuple[str, int], list] = {}
    for h in range(hour - hours + 1, hour + 1):
        for name, value in client.hgetall(wait_stats_key(h)).items():
            priority, tenant_id, kind = name.decode().split("|")
            entry = totals.setdefault((priority, int(tenant_id)), [0, 0.0])
            if kind == "n":
                entry[0] += int(value)
            else:
                entry[1] += float(value)
    return [WaitStat(p, t, n, s) for (p, t), (n, s) in totals.items()]


@dataclass(slots=True)
class Claim:
    """One request's claim on an engine slot of its model: what the queue ranks it by (its
    class, its tenant's fair share of tokens), what admits it (a free slot, room in the KV
    cache), and what it may do to others or they to it (preemption, gateway/preempt.py)."""

    request_id: str
    model_id: int
    budget: int  # the static budget of the model's engines (their max_num_seqs)
    priority: str  # P0, P1 or P2
    tenant_id: int
    weight: int  # the tenant's fair-share weight
    cost: int  # the tokens reserved for it: fair share is counted in these
    kv: int = 0  # predicted in-flight tokens: prompt estimate + expected output
    preempts: bool = False  # it may take the slot of a preemptible lower-class request
    victim: bool = False  # it may be preempted
    head: bool = False  # preempted: it queues again at the head of its class


@dataclass(slots=True)
class Waiter:
    """A claim waiting in this process; ``event`` set: try for a slot now."""

    claim: Claim
    gone: asyncio.Event  # set when the client leaves
    started: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Ticket:
    """What waiting produced: a slot, or how long a client should wait before retrying."""

    admitted: bool
    waited: float
    retry_after: int = 0


class Admission:
    """One gateway process's view of every model's engine pool."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._retry = client.register_script(RETRY_LUA)
        self.waiters: dict[int, list[Waiter]] = {}
        self.running: dict[str, int] = {}  # request id -> model id (for lease renewal)
        self.p2_open: dict[int, bool] = {}  # from engine telemetry
        self.latency: dict[int, float] = {}  # EWMA seconds per request, per model
        self.kv_capacity: dict[int, int] = {}  # from engine telemetry, tokens, per model
        self.output: dict[int, float] = {}  # EWMA completion tokens per request, per model
        # The controller's verdict per model: False where the gateway's preemption frees no
        # engine slot (the engines finish what it aborts), so the gateway does not preempt
        # there; absent or True: it does (gateway/controller.py judge_preemption).
        self.preempt_frees: dict[int, bool] = {}
        self._verdicts_shown: dict[int, int] = {}  # model id -> the gauge's value

    def predicted_tokens(self, model_id: int, prompt: int, asked_output: int, limit: int) -> int:
        """What a request will hold in the KV cache: its prompt estimate plus the output it
        is expected to produce (the model's recent mean, at most what it asked for), at most
        the model's context length."""
        expected = self.output.get(model_id) or setting("TOLLGATE_ADMISSION_EXPECTED_OUTPUT")
        output = min(asked_output, max(int(expected), 16)) if asked_output else 0
        return min(prompt + output, limit) if limit > 0 else prompt + output

    def slot_request(self, claim: Claim) -> SlotRequest:
        """What the admission call (or a queued claim's next try) needs to take, or queue
        for, an engine slot: the claim beside this process's view of the model's engines."""
        model_id, budget = claim.model_id, claim.budget
        headroom = setting("TOLLGATE_ADMISSION_HEADROOM_SECONDS")
        return SlotRequest(
            pool=pool_keys(model_id),
            priority_index=CLASS_INDEX[claim.priority],
            weight=claim.weight,
            budget=budget,
            p2_open=self.p2_open.get(model_id, True),
            give_up_ms=int(queue_timeout(claim.priority) * 1000) + 5000,
            lease_ms=lease_ms(),
            kv=claim.kv,
            kv_capacity=self.kv_capacity.get(model_id, 0),
            headroom_ms=int(headroom * 1000),
            headroom_max=headroom_slots(budget),
            # The verdict now, not when the request came: once preempting frees nothing on
            # the model, requests queued before it stop ignoring the headroom as victims.
            preempt=claim.preempts and self.preempt_frees.get(model_id, True),
            victim=claim.victim and self.preempt_frees.get(model_id, True),
        )

    def holding(self, request_id: str, model_id: int) -> None:
        """The request holds a slot: keep its lease renewed until it finishes."""
        self.running[request_id] = model_id

    async def wait(self, claim: Claim, gone: asyncio.Event) -> Ticket:
        """Wait in the queue (where admission put the request) up to its class's timeout, or
        until ``gone`` is set (its client left). A claim at the ``head`` of its class (a
        preempted request) tries at once: a slot may be free."""
        waiter = Waiter(claim, gone)
        self.waiters.setdefault(claim.model_id, []).append(waiter)
        labels = (claim.priority, str(claim.tenant_id))
        metrics.QUEUE_DEPTH.labels(*labels).inc()
        admitted = False
        try:
            ticket = await self._wait(waiter)
            admitted = ticket.admitted
            return ticket
        finally:
            if not admitted:  # also on an error or a cancellation: leave no queue entry
                await self._leave_queue(claim)
            waited = time.monotonic() - waiter.started
            metrics.QUEUE_DEPTH.labels(*labels).dec()
            metrics.QUEUE_WAIT.labels(*labels).observe(waited)
            self.waiters[claim.model_id].remove(waiter)
            await self._record_wait(claim.priority, claim.tenant_id, waited)

    async def _leave_queue(self, claim: Claim) -> None:
        """Take a request that stops waiting off the queue (best effort: an entry left behind
        is dropped by the next request behind it, once this one's record is closed)."""
        _, queue, expiry, *_ = pool_keys(claim.model_id)
        try:
            async with asyncio.timeout(2.0):
                pipe = self.redis.pipeline(transaction=False)
                pipe.zrem(queue, claim.request_id)
                pipe.zrem(expiry, claim.request_id)
                await asyncio.shield(pipe.execute())
        except Exception:  # noqa: BLE001 - see above
            log.warning("could not take request %s off the queue", claim.request_id)

    async def _record_wait(self, priority: str, tenant_id: int, waited: float) -> None:
        """Per-hour count and total of queue waits by class and tenant, for the console."""
        key = wait_stats_key(int(time.time() // 3600))
        field = f"{priority}|{tenant_id}"
        try:
            async with asyncio.timeout(1.0):
                pipe = self.redis.pipeline(transaction=False)
                pipe.hincrby(key, f"{field}|n", 1)
                pipe.hincrbyfloat(key, f"{field}|s", round(waited, 4))
                pipe.expire(key, 3 * 3600)
                await pipe.execute()
        except Exception:  # noqa: BLE001 - statistics only
            pass

    async def _wait(self, waiter: Waiter) -> Ticket:
        claim = waiter.claim
        deadline = waiter.started + queue_timeout(claim.priority)
        ahead, ceiling = 1, claim.budget
        if claim.head:
            waiter.event.set()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or waiter.gone.is_set():
                retry = self.retry_after(claim.model_id, ahead, ceiling)
                return Ticket(False, time.monotonic() - waiter.started, retry)
            if not waiter.event.is_set():
                try:
                    await asyncio.wait_for(waiter.event.wait(), min(remaining, RETRY_SECONDS))
                except TimeoutError:
                    pass
            waiter.event.clear()
            got, ahead, ceiling = await self._try(claim)
            if got == 1:
                self.running[claim.request_id] = claim.model_id
                # More slots may be free: let the next local waiter try.
                self.wake_local(claim.model_id)
                return Ticket(True, time.monotonic() - waiter.started)

    async def _try(self, claim: Claim) -> list[int]:
        """One try of a queued claim for a slot (retry_slot.lua): [1, running, ceiling] when
        it got one, else [0, requests ranked ahead, ceiling]."""
        slot = self.slot_request(claim)
        args = [
            claim.request_id,
            slot.priority_index,
            str(claim.tenant_id),
            claim.weight,
            claim.cost,
            int(time.time() * 1000),
            slot.lease_ms,
            claim.budget,
            "1" if slot.p2_open else "0",
            slot.give_up_ms,
            claim.kv,
            slot.kv_capacity,
            slot.headroom_ms,
            slot.headroom_max,
            1 if slot.preempt else 0,
            1 if slot.victim else 0,
            1 if claim.head else 0,
            preempt_channel(),
        ]
        async with asyncio.timeout(5.0):
            # With the checkpoints hash: a granted slot marks the request as taken by an engine.
            opened, _, checkpoints = open_keys()
            result = await self._retry(
                keys=[*slot.pool, checkpoints, opened], args=[orjson.dumps(args)]
            )
        return [int(x) for x in result]

    def wake_local(self, model_id: int) -> None:
        """Let this process's waiters of a model retry now (best-ranked first is fine: the
        queue decides who wins)."""
        for waiter in self.waiters.get(model_id, ()):
            waiter.event.set()

    def finished(
        self, request_id: str, model_id: int, seconds: float, output_tokens: int = 0
    ) -> None:
        self.running.pop(request_id, None)
        previous = self.latency.get(model_id)
        self.latency[model_id] = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        if output_tokens > 0:
            mean = self.output.get(model_id)
            self.output[model_id] = (
                output_tokens if mean is None else 0.9 * mean + 0.1 * output_tokens
            )

    def retry_after(self, model_id: int, ahead: int, ceiling: int) -> int:
        """Seconds until the queue ahead would drain: ahead / (slots / mean request time)."""
        mean = self.latency.get(model_id, 5.0)
        return max(1, int((ahead + 1) * mean / max(ceiling, 1)) + 1)

    async def renew_leases(self, open_requests: set[str]) -> None:
        """Keep this process's leases alive: engine slots of running requests and the records
        of open ones. A killed process stops renewing, so its leases lapse and are reaped."""
        interval = lease_ms() / 3000
        while True:
            await asyncio.sleep(interval)
            deadline = int(time.time() * 1000) + lease_ms()
            pipe = self.redis.pipeline(transaction=False)
            models = set()
            for request_id, model_id in list(self.running.items()):
                pipe.zadd(pool_keys(model_id)[0], {request_id: deadline}, xx=True)
                models.add(model_id)
            for model_id in models:  # the slot sets outlive their last admission
                pool = pool_keys(model_id)
                pipe.pexpire(pool[0], lease_ms())
                pipe.pexpire(pool[5], lease_ms())
                pipe.pexpire(pool[7], lease_ms())
            if open_requests:
                pipe.zadd(open_keys()[0], dict.fromkeys(open_requests, deadline), xx=True)
            try:
                await pipe.execute()
            except Exception:  # noqa: BLE001 - Redis away: leases outlive a short outage
                log.warning("could not renew leases", exc_info=True)

    async def watch_telemetry(self, routes: object, models: Callable[[], dict] = dict) -> None:
        """Every second: may P2 run on each model (engines not waiting, KV cache not full)?
        And does preempting free an engine slot there? (``models``: served name -> ModelInfo,
        for the metric's labels.)"""
        threshold = settings.TOLLGATE_P2_KV_CACHE_THRESHOLD
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._refresh_p2(routes(), threshold, models)
            except Exception:  # noqa: BLE001 - keep the last answer
                log.warning("could not read engine telemetry", exc_info=True)

    async def _refresh_p2(
        self, routes: dict, threshold: float, models: Callable[[], dict] = dict
    ) -> None:
        replicas = [(model_id, u) for model_id, ups in routes.items() for u in ups]
        if not replicas:
            return
        # The verdicts come in the same read as the telemetry: no extra round trip.
        model_ids = list(routes)
        raw = await self.redis.mget(
            [engine_metrics_key(u.replica_id) for _, u in replicas]
            + [preempt_verdict_key(m) for m in model_ids]
        )
        raw, verdicts = raw[: len(replicas)], raw[len(replicas) :]
        self.preempt_frees = {m: v != b"0" for m, v in zip(model_ids, verdicts, strict=True)}
        self._show_verdicts(dict(zip(model_ids, verdicts, strict=True)), models)
        now, verdict, capacity = time.time(), {}, {}
        share = settings.TOLLGATE_ADMISSION_KV_SHARE
        for (model_id, _upstream), blob in zip(replicas, raw, strict=True):
            figures = orjson.loads(blob) if blob else None
            fresh = figures and now - figures.get("scraped_at", 0) < TELEMETRY_FRESH_SECONDS
            # The KV cache requests may fill, summed over the replicas that report one; a
            # replica that does not (yet) leaves the model without a token limit.
            kv = int(figures.get("kv_capacity_tokens", 0) * share) if fresh else 0
            if capacity.get(model_id, 0) >= 0:
                capacity[model_id] = capacity.get(model_id, 0) + kv if kv > 0 else -1
            # Without fresh telemetry only the slot ceiling limits P2.
            queued = figures.get("waiting", 0) if fresh else 0
            spare = not fresh or (queued == 0 and figures.get("kv_cache_usage", 0) < threshold)
            verdict[model_id] = verdict.get(model_id, False) or spare
        self.p2_open = verdict
        self.kv_capacity = {m: c for m, c in capacity.items() if c > 0}

    def _show_verdicts(self, verdicts: dict[int, bytes | None], models: Callable[[], dict]) -> None:
        """tollgate_admission_preemption_effective{model}: 1, 0, or -1 (not judged)."""
        values = {m: -1 if v is None else int(v != b"0") for m, v in verdicts.items()}
        changed = {m: v for m, v in values.items() if self._verdicts_shown.get(m) != v}
        if not changed:
            return
        names = {info.id: name for name, info in models().items()}
        for model_id, value in changed.items():
            if model_id in names:
                metrics.child(metrics.PREEMPTION_EFFECTIVE, names[model_id]).set(value)
                self._verdicts_shown[model_id] = value
