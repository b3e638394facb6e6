"""Rate limits, concurrency and quotas in Redis: one Lua call to admit, one to settle."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from config.redis import rkey
from gateway.state import KeyInfo, TenantInfo
from metering.events import stream_key
from metering.quota import QUOTA_TTL_SECONDS, quota_key

WINDOW_MS = 60_000
# A request that never settles (its gateway died) stops counting as in flight after this.
IN_FLIGHT_DEADLINE_MS = 15 * 60_000

_HERE = Path(__file__).parent
ADMIT_LUA = (_HERE / "limiter.lua").read_text()
SETTLE_LUA = (_HERE / "settle.lua").read_text()

REASONS = {
    1: ("requests", "key"), 2: ("requests", "tenant"), 3: ("tokens", "key"), 4: ("tokens", "tenant"),
    5: ("concurrency", "key"), 6: ("concurrency", "tenant"), 7: ("quota_tokens", "tenant"),
    8: ("quota_money", "tenant"), 9: ("too_large", "key"),
}


@dataclass(frozen=True, slots=True)
class Reservation:
    """What admission set aside for a request; settle releases exactly this."""

    request_id: str
    keys: tuple[str, ...]
    tokens: int
    money_nano: int


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: str  # "" when admitted; else requests/tokens/concurrency/quota_tokens/quota_money/too_large
    scope: str
    retry_ms: int
    limit_requests: int  # -1: no request limit applies
    remaining_requests: int
    reset_requests_ms: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int
    reservation: Reservation | None


def _keys(key: KeyInfo, tenant: TenantInfo, at: float) -> tuple[str, ...]:
    return (
        rkey("rl", "k", key.id), rkey("rl", "k", key.id, "t"),
        rkey("rl", "t", tenant.id), rkey("rl", "t", tenant.id, "t"),
        rkey("cc", "k", key.id), rkey("cc", "t", tenant.id),
        quota_key(tenant.id, tenant.quota_period, _utc(at)),
    )


def _utc(at: float) -> object:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(at, UTC)


class Limiter:
    """Atomic admission and settlement against one Redis."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._admit = client.register_script(ADMIT_LUA)
        self._settle = client.register_script(SETTLE_LUA)

    async def admit(
        self, request_id: str, key: KeyInfo, tenant: TenantInfo, tokens: int, money_nano: int,
        now: float | None = None,
    ) -> Decision:
        """Admit a request that may use ``tokens`` tokens costing ``money_nano``, or say why not."""
        now = time.time() if now is None else now
        now_ms = int(now * 1000)
        keys = _keys(key, tenant, now)
        argv = [
            now_ms, request_id, tokens, WINDOW_MS,
            key.limits.rpm, key.limits.tpm, tenant.limits.rpm, tenant.limits.tpm,
            key.limits.concurrent, tenant.limits.concurrent,
            tenant.quota_tokens, tenant.quota_money_nano, money_nano,
            now_ms + IN_FLIGHT_DEADLINE_MS, QUOTA_TTL_SECONDS,
        ]
        code, retry, lreq, rreq, sreq, ltok, rtok, stok = await self._admit(keys=keys, args=argv)
        reason, scope = REASONS.get(int(code), ("", ""))
        reservation = Reservation(request_id, keys, tokens, money_nano) if code == 0 else None
        return Decision(
            admitted=code == 0, reason=reason, scope=scope, retry_ms=int(retry),
            limit_requests=int(lreq), remaining_requests=int(rreq), reset_requests_ms=int(sreq),
            limit_tokens=int(ltok), remaining_tokens=int(rtok), reset_tokens_ms=int(stok),
            reservation=reservation,
        )

    async def settle(self, reservation: Reservation, tokens: int, money_nano: int, event: bytes,
                     model_id: int) -> None:
        """Correct the reservation with real usage, release it and the engine slot, and
        append the usage event."""
        from gateway.admission import pool_keys, wake_channel

        k = reservation.keys
        running, queue = pool_keys(model_id)[:2]
        await self._settle(
            keys=[k[1], k[3], k[4], k[5], k[6], stream_key(), rkey("settled", reservation.request_id),
                  running, queue],
            args=[reservation.request_id, reservation.tokens, tokens, reservation.money_nano,
                  money_nano, event, wake_channel(), model_id],
        )
