"""Rate limits, concurrency and quotas in Redis: one Lua call to admit (which also tries
for an engine slot), one to settle."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

import orjson
import redis.asyncio as aioredis

from core.hot import setting
from core.keyspace import (
    PREFIX_SETTING,
    QUOTA_TTL_SECONDS,
    open_keys,
    pool_keys,
    preempt_channel,
    quota_key,
    rate_keys,
    settled_stem,
    usage_stream,
    wake_channel,
)
from gateway.redispipe import RedisPipe, Script
from gateway.state import KeyInfo, TenantInfo
from metering.periods import period_id

WINDOW_MS = 60_000
# A request that never settles (its gateway died) stops counting as in flight after this.
IN_FLIGHT_DEADLINE_MS = 15 * 60_000

_HERE = Path(__file__).parent
SLOT_LUA = (_HERE / "acquire.lua").read_text()
ADMIT_LUA = SLOT_LUA + (_HERE / "limiter.lua").read_text()
SETTLE_LUA = (_HERE / "settle.lua").read_text()

REASONS = {
    1: ("requests", "key"),
    2: ("requests", "tenant"),
    3: ("tokens", "key"),
    4: ("tokens", "tenant"),
    5: ("concurrency", "key"),
    6: ("concurrency", "tenant"),
    7: ("quota_tokens", "tenant"),
    8: ("quota_money", "tenant"),
    9: ("too_large", "key"),
}


# The per-request records here are not frozen: a frozen dataclass's __init__ sets every field
# through object.__setattr__, ~9 % of a chat request's instructions on the gateway
# (bench/gateway_instructions.py). Nothing changes them after they are made.


@dataclass(slots=True)
class Reservation:
    """What admission set aside for a request; settle releases exactly this."""

    request_id: str
    keys: tuple[str, ...]
    tokens: int
    money_nano: int


@dataclass(slots=True)
class Decision:
    admitted: bool
    reason: (
        str  # "" when admitted; else requests/tokens/concurrency/quota_tokens/quota_money/too_large
    )
    scope: str
    retry_ms: int
    limit_requests: int  # -1: no request limit applies
    remaining_requests: int
    reset_requests_ms: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int
    reservation: Reservation | None
    slot: bool  # admitted and already holding an engine slot (else queued for one)


@dataclass(slots=True)
class SlotRequest:
    """Where and how an admitted request asks for an engine slot."""

    pool: tuple[str, ...]  # core.keyspace.pool_keys(model id)
    priority_index: int
    weight: int
    budget: int
    p2_open: bool
    give_up_ms: int
    lease_ms: int
    kv: int = 0  # predicted in-flight tokens: prompt estimate + expected output
    kv_capacity: int = 0  # the engines' KV cache for admission, in tokens (0: unknown)
    headroom_ms: int = 0  # window of recent higher-class demand (0: no headroom)
    headroom_max: int = 0  # most slots lower classes leave free
    preempt: bool = False  # a P0/P1 request may take a preemptible lower-class slot
    victim: bool = False  # this request may be preempted (the gateway resumes it)


@lru_cache(maxsize=65536)
def _keys_at(prefix: str, key_id: int, tenant_id: int, period: str, hour: int) -> tuple[str, ...]:
    """limiter.lua's KEYS 1-7 (cached per prefix: tests change it)."""
    period_of_hour = period_id(period, datetime.fromtimestamp(hour * 3600, UTC))
    return (*rate_keys(key_id, tenant_id), quota_key(tenant_id, period_of_hour))


def _keys(key: KeyInfo, tenant: TenantInfo, at: float) -> tuple[str, ...]:
    # Periods start on whole UTC hours (days, weeks, months), so the hour picks the period.
    return _keys_at(
        setting(PREFIX_SETTING), key.id, tenant.id, tenant.quota_period, int(at // 3600)
    )


_ADMIT = Script(ADMIT_LUA)
_SETTLE = Script(SETTLE_LUA)


def lease_ms() -> int:
    """How long an engine slot and an open request's record outlive their gateway process's
    last renewal (then the reaper settles the request: gateway/orphans.py)."""
    return int(setting("TOLLGATE_GATEWAY_LEASE_SECONDS") * 1000)


class Limiter:
    """Atomic admission and settlement against one Redis (a pipelined connection: see
    gateway/redispipe.py; a call that gets no answer within its timeout fails closed)."""

    def __init__(self, client: aioredis.Redis, pipe: RedisPipe | None = None) -> None:
        self.redis = client
        self.pipe = pipe or RedisPipe.like(client)

    async def aclose(self) -> None:
        await self.pipe.aclose()

    async def admit(
        self,
        request_id: str,
        key: KeyInfo,
        tenant: TenantInfo,
        tokens: int,
        money_nano: int,
        slot: SlotRequest,
        record: dict,
        now: float | None = None,
    ) -> Decision:
        """Admit a request that may use ``tokens`` tokens costing ``money_nano``, or say why not."""
        now = time.time() if now is None else now
        now_ms = int(now * 1000)
        keys = _keys(key, tenant, now)
        argv = [
            now_ms,
            request_id,
            tokens,
            WINDOW_MS,
            key.limits.rpm,
            key.limits.tpm,
            tenant.limits.rpm,
            tenant.limits.tpm,
            key.limits.concurrent,
            tenant.limits.concurrent,
            tenant.quota_tokens,
            tenant.quota_money_nano,
            money_nano,
            now_ms + IN_FLIGHT_DEADLINE_MS,
            QUOTA_TTL_SECONDS,
            slot.priority_index,
            slot.weight,
            slot.budget,
            "1" if slot.p2_open else "0",
            slot.lease_ms,
            slot.give_up_ms,
            str(tenant.id),
            orjson.dumps({**record, "keys": keys, "tokens": tokens, "money": money_nano}).decode(),
            now_ms + slot.lease_ms,
            slot.kv,
            slot.kv_capacity,
            slot.headroom_ms,
            slot.headroom_max,
            1 if slot.preempt else 0,
            1 if slot.victim else 0,
            preempt_channel(),
        ]
        result = await self.pipe.evalsha(
            _ADMIT, (*keys, *slot.pool, *open_keys()), (orjson.dumps(argv),)
        )
        reservation = Reservation(request_id, keys, tokens, money_nano)
        return _decision(result, reservation)

    async def settle(
        self, reservation: Reservation, tokens: int, money_nano: int, event: bytes, model_id: int
    ) -> None:
        """Correct the reservation with real usage, release it and the engine slot, and
        append the usage event."""
        keys, args = settle_keys(reservation, tokens, money_nano, event, model_id)
        await self.pipe.evalsha(_SETTLE, keys, args)


def _decision(result: list[int], reservation: Reservation) -> Decision:
    """limiter.lua's answer; ``reservation``: what it set aside if it admitted."""
    code, retry, lreq, rreq, sreq, ltok, rtok, stok, got_slot = result
    reason, scope = REASONS.get(code, ("", ""))
    return Decision(
        admitted=code == 0,
        reason=reason,
        scope=scope,
        retry_ms=retry,
        limit_requests=lreq,
        remaining_requests=rreq,
        reset_requests_ms=sreq,
        limit_tokens=ltok,
        remaining_tokens=rtok,
        reset_tokens_ms=stok,
        reservation=reservation if code == 0 else None,
        slot=got_slot == 1,
    )


def settle_keys(
    reservation: Reservation, tokens: int, money_nano: int, event: bytes, model_id: int
) -> tuple[list[str], list[object]]:
    """KEYS and ARGV of settle.lua (shared with the orphan reaper)."""
    stream, wake, opened, settled = _settle_names(setting(PREFIX_SETTING))
    k = reservation.keys
    pool = pool_keys(model_id)
    running, queue, in_flight, preemptible = pool[0], pool[1], pool[5], pool[7]
    keys = [
        k[1],
        k[3],
        k[4],
        k[5],
        k[6],
        stream,
        settled + reservation.request_id,
        running,
        queue,
        *opened,
        in_flight,
        preemptible,
    ]
    args = [
        reservation.request_id,
        reservation.tokens,
        tokens,
        reservation.money_nano,
        money_nano,
        event.decode(),
        wake,
        model_id,
    ]
    return keys, [orjson.dumps(args)]


@lru_cache(maxsize=16)
def _settle_names(prefix: str) -> tuple[str, str, tuple[str, str, str], str]:
    """(usage stream, wake channel, open-request keys, settled-mark stem) under one prefix."""
    return usage_stream(), wake_channel(), open_keys(), settled_stem()
