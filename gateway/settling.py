"""Settling one request (gateway/exchange.py): bill what was delivered (gateway/billing.py
decides what), then release its reservation and engine slot and write its usage record in
one Lua call (gateway/limiter.py). While a stream runs, its delivered tokens are
checkpointed about once a second, for the orphan reaper (gateway/orphans.py) should this
process die first.
"""

from __future__ import annotations

import asyncio
import time

import redis.exceptions

from core.keyspace import open_keys
from core.pricing import cost_nano
from core.usage import UsageRecord
from gateway import billing, metrics
from gateway.exchange import Exchange
from gateway.limiter import Reservation
from gateway.state import Upstream
from gateway.usage import Outcome, checkpoint_value


async def checkpoint(ex: Exchange, o: Outcome) -> None:
    """Record a stream's delivered tokens (about once a second) for the orphan reaper."""
    value = checkpoint_value(
        o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.reasoning_tokens
    )
    try:
        async with asyncio.timeout(1.0):
            await ex.rt.pipe.call(b"HSET", open_keys()[2], ex.request_id, value)
    except (redis.exceptions.RedisError, OSError, TimeoutError):
        pass  # the final settle carries the exact figures; this only covers a crash


async def settle(
    ex: Exchange, reservation: Reservation, outcome: Outcome, upstream: Upstream | None
) -> None:
    """Bill what was delivered, release the reservation and the slot, record the usage."""
    billable = billing.billable(ex.endpoint, outcome)
    if billable and not outcome.prompt_known and ex.endpoint in billing.PROMPT_COUNTS:
        await billing.count_prompt(
            ex.rt.session, ex.endpoint, ex.payload, outcome, upstream, ex.upstreams
        )
    if not billable:
        outcome.prompt_tokens = outcome.cached_tokens = outcome.completion_tokens = (
            outcome.reasoning_tokens
        ) = 0
    tokens = outcome.prompt_tokens + outcome.completion_tokens
    money = 0
    if ex.price and tokens:
        money = cost_nano(
            ex.price, outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens
        )
    latency = time.perf_counter() - ex.started
    record = usage_record(ex, outcome, upstream, latency)
    await ex.rt.settle(reservation, tokens, money, record.encode(), ex.model.id)
    metrics.request_done(
        ex.tenant.slug,
        ex.model.served_name,
        ex.endpoint,
        outcome.status,
        latency,
        None if outcome.ttft_ms is None else outcome.ttft_ms / 1000,
        outcome.prompt_tokens,
        outcome.completion_tokens,
    )


def usage_record(
    ex: Exchange, outcome: Outcome, upstream: Upstream | None, latency: float
) -> UsageRecord:
    """The request's one usage event (core/usage.py), as billed."""
    price = ex.price
    return UsageRecord(
        request_id=ex.request_id,
        occurred_at=ex.occurred,
        tenant_id=ex.tenant.id,
        api_key_id=ex.key.id,
        model_id=ex.model.id,
        adapter_id=ex.model.adapter_id or None,
        deployment_id=upstream.deployment_id if upstream else None,
        endpoint=ex.endpoint,
        priority=ex.claim.priority,
        prompt_tokens=outcome.prompt_tokens,
        cached_tokens=outcome.cached_tokens,
        completion_tokens=outcome.completion_tokens,
        reasoning_tokens=outcome.reasoning_tokens,
        status=outcome.status,
        http_status=outcome.http_status or 499,
        latency_ms=int(latency * 1000),
        ttft_ms=outcome.ttft_ms,
        price_id=price.id if price else None,
        prompt_estimated=outcome.prompt_estimated,
        start_wait_ms=ex.start_wait_ms,
        replica_id=upstream.replica_id if upstream else None,
        preemptions=outcome.preemptions,
    )
