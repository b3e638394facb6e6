"""Requests whose gateway died mid-flight: found by their lapsed lease, billed for what they
delivered, and released.

At admission every request is put on record in Redis (the admit Lua call), with what its
prompt needs to be counted (gateway/billing.py ``orphan_prompt``); taking an engine slot
opens its checkpoint (the request goes to an engine now); streams checkpoint their
delivered tokens about once a second; settling removes the record. A gateway process
renews its records' leases while it lives. When a process is killed, its records' leases
lapse and ``reap`` settles each one exactly as the dead process would have (the settle
script is idempotent per request id): a request an engine took pays its prompt (the
engine's running usage, else its tokenizer, else the estimate marked ``prompt_estimated``)
and the tokens delivered up to the last checkpoint; one that never reached an engine pays
nothing. The reservation and engine slot are released, one usage event is written.
"""

from __future__ import annotations

import logging
import time

import orjson

from core.keyspace import open_keys
from core.pricing import Rates, cost_nano
from core.redis import get_redis
from core.usage import UsageRecord
from gateway.billing import count_prompt_sync
from gateway.limiter import SETTLE_LUA, Reservation, settle_keys
from gateway.state import Upstream, load_routes
from gateway.usage import checkpoint_counts

log = logging.getLogger("tollgate.gateway")


def reap(now: float | None = None, limit: int = 500) -> int:
    """Settle every open request whose lease lapsed; returns how many."""
    now = time.time() if now is None else now
    client = get_redis()
    zset, records, checkpoints = open_keys()
    lapsed = client.zrangebyscore(zset, "-inf", int(now * 1000), start=0, num=limit)
    settle = client.register_script(SETTLE_LUA)
    engines: dict[int, list[Upstream]] | None = None
    for raw_id in lapsed:
        request_id = raw_id.decode()
        record, checkpoint = client.hget(records, request_id), client.hget(checkpoints, request_id)
        if record is None:
            client.zrem(zset, request_id)
            continue
        opened = orjson.loads(record)
        prompt, completion, cached, reasoning = checkpoint_counts(checkpoint)
        estimated = False
        kept = opened.get("prompt")
        if checkpoint is None or kept is None:
            # Never taken by an engine (or an endpoint whose prompt is not billed on its own):
            # what reached the client, if anything, is all that is billed.
            if not completion:
                prompt = cached = reasoning = 0
        elif not prompt:
            if engines is None:  # only when some orphan needs counting
                engines = load_routes()
            prompt, estimated = count_prompt_sync(
                kept, engines.get(opened["event"]["model_id"], [])
            )
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
            prompt_estimated=estimated,
        )
        reservation = Reservation(
            request_id, tuple(opened["keys"]), opened["tokens"], opened["money"]
        )
        keys, args = settle_keys(
            reservation, tokens, money, event.encode(), opened["event"]["model_id"]
        )
        settle(keys=keys, args=args)
        log.warning(
            "billed %s after its gateway died: %d prompt tokens%s, %d delivered",
            request_id,
            prompt,
            " (estimated)" if estimated else "",
            completion,
        )
    return len(lapsed)
