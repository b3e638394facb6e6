"""Requests whose gateway died mid-flight: found by their lapsed lease, billed for what they
delivered, and released.

At admission every request is put on record in Redis (the admit Lua call); streams
checkpoint their delivered tokens about once a second; settling removes the record. A
gateway process renews its records' leases while it lives. When a process is killed, its
records' leases lapse and ``reap`` settles each one exactly as the dead process would have
(the settle script is idempotent per request id): tokens delivered up to the last
checkpoint are billed, the reservation and engine slot are released, one usage event is
written.
"""

from __future__ import annotations

import logging
import time

import orjson

from core.hot import setting
from core.keyspace import open_keys
from core.pricing import Rates, cost_nano
from core.redis import get_redis
from core.usage import UsageRecord
from gateway.limiter import SETTLE_LUA, Reservation, settle_keys

log = logging.getLogger("tollgate.gateway")

CHECKPOINT_SECONDS = 1.0


def lease_ms() -> int:
    return int(setting("TOLLGATE_GATEWAY_LEASE_SECONDS") * 1000)


def checkpoint_value(prompt: int, completion: int, cached: int, reasoning: int) -> str:
    return f"{prompt},{completion},{cached},{reasoning}"


def reap(now: float | None = None, limit: int = 500) -> int:
    """Settle every open request whose lease lapsed; returns how many."""
    now = time.time() if now is None else now
    client = get_redis()
    zset, records, checkpoints = open_keys()
    lapsed = client.zrangebyscore(zset, "-inf", int(now * 1000), start=0, num=limit)
    settle = client.register_script(SETTLE_LUA)
    for raw_id in lapsed:
        request_id = raw_id.decode()
        record, checkpoint = client.hget(records, request_id), client.hget(checkpoints, request_id)
        if record is None:
            client.zrem(zset, request_id)
            continue
        opened = orjson.loads(record)
        prompt, completion, cached, reasoning = (
            [int(x) for x in checkpoint.decode().split(",")] if checkpoint else [0, 0, 0, 0]
        )
        if not completion:  # nothing reached the client: nothing is billed
            prompt = cached = reasoning = 0
        tokens, price = prompt + completion, opened.get("price")
        money = cost_nano(Rates(*price), prompt, cached, completion) if price and tokens else 0
        event = UsageRecord(
            **opened["event"],
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            reasoning_tokens=reasoning,
            status="error",
            http_status=502,
            latency_ms=int((now - opened["event"]["occurred_at"]) * 1000),
            ttft_ms=None,
        )
        reservation = Reservation(
            request_id, tuple(opened["keys"]), opened["tokens"], opened["money"]
        )
        keys, args = settle_keys(
            reservation, tokens, money, event.encode(), opened["event"]["model_id"]
        )
        settle(keys=keys, args=args)
        log.warning("billed %s after its gateway died: %d tokens delivered", request_id, completion)
    return len(lapsed)
