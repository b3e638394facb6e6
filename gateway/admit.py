"""Admitting one request (gateway/exchange.py): what it reserves, its class, the body its
engine gets, its open record, the one Lua call that admits it (gateway/limiter.py: rate
limits, concurrency, quota and an engine slot), its wait in the priority queue when every
slot is taken (gateway/admission.py keeps the queue), and the answer when it is refused.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from datetime import UTC, datetime

import orjson
import redis.exceptions

from core.pricing import cost_nano
from gateway import billing, metrics, preempt
from gateway.admission import CLASS_INDEX, Claim, lowered
from gateway.errors import error_body
from gateway.exchange import PROMPT_ONLY, STREAM_OPTIONS, Exchange
from gateway.limiter import Decision
from gateway.relay import respond
from gateway.state import ModelInfo, TenantInfo
from gateway.usage import Outcome
from metering.periods import period_end

log = logging.getLogger("tollgate.gateway")


def _duration(ms: int) -> bytes:
    """OpenAI's reset format: 1s, 6m0s, 20ms."""
    if ms < 1000:
        return f"{max(ms, 0)}ms".encode()
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s".encode()
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s".encode()


def ratelimit_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    headers = []
    if decision.limit_requests > 0:
        headers += [
            (b"x-ratelimit-limit-requests", str(decision.limit_requests).encode()),
            (b"x-ratelimit-remaining-requests", str(max(decision.remaining_requests, 0)).encode()),
            (b"x-ratelimit-reset-requests", _duration(decision.reset_requests_ms)),
        ]
    if decision.limit_tokens > 0:
        headers += [
            (b"x-ratelimit-limit-tokens", str(decision.limit_tokens).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(decision.remaining_tokens, 0)).encode()),
            (b"x-ratelimit-reset-tokens", _duration(decision.reset_tokens_ms)),
        ]
    return headers


def quota_reset_seconds(period: str, now: float) -> int:
    """Whole seconds until the quota period containing ``now`` ends (at least 1)."""
    ends = period_end(period, datetime.fromtimestamp(now, UTC)).timestamp()
    return max(1, math.ceil(ends - now))


def refusal(
    decision: Decision, tenant: TenantInfo, now: float
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The 429 for a refused admission, with Retry-After where waiting helps."""
    headers = ratelimit_headers(decision)
    reason, scope = decision.reason, decision.scope
    if reason in ("quota_tokens", "quota_money"):
        what = "token" if reason == "quota_tokens" else "spending"
        body = error_body(
            f"You exceeded your tenant's {what} quota for this period. Ask your tenant admin to "
            "raise it, or wait for the next period.",
            "insufficient_quota",
            code="insufficient_quota",
        )
        # The honest wait is until the period resets (hours or days): the SDKs should not
        # retry on their own (x-should-retry, which the openai and anthropic SDKs obey).
        headers += [
            (b"retry-after", str(quota_reset_seconds(tenant.quota_period, now)).encode()),
            (b"x-should-retry", b"false"),
        ]
        return 429, body, headers
    if reason == "too_large":
        body = error_body(
            f"Request too large: it may use more tokens than the {scope}'s tokens-per-minute limit "
            f"of {decision.limit_tokens}. Lower max_tokens or shorten the prompt.",
            "tokens",
            code="rate_limit_exceeded",
        )
        return 429, body, headers
    wait_s = max(decision.retry_ms, 1) / 1000
    label = {
        "requests": "requests per min (RPM)",
        "tokens": "tokens per min (TPM)",
        "concurrency": "concurrent requests",
    }[reason]
    body = error_body(
        f"Rate limit reached for {label} on this {scope}. Please try again in {wait_s:.3g}s.",
        "tokens" if reason == "tokens" else "requests",
        code="rate_limit_exceeded",
    )
    headers += [
        (b"retry-after", str(max(1, -(-decision.retry_ms // 1000))).encode()),
        (b"retry-after-ms", str(max(decision.retry_ms, 1)).encode()),
    ]
    return 429, body, headers


STORE_DOWN = error_body(
    "Tollgate cannot reach its rate-limit store, so it cannot admit requests right now. Please "
    "retry shortly.",
    "server_error",
    code="service_unavailable",
)
QUEUE_DOWN = error_body(
    "Tollgate cannot reach its admission queue right now. Please retry shortly.",
    "server_error",
    code="service_unavailable",
)


def estimate(body: bytes, payload: dict, model: ModelInfo, endpoint: str) -> tuple[int, int]:
    """(prompt, output) token reservation. ~4 bytes a token overestimates real prompts."""
    prompt = len(body) // 4 + 8
    if endpoint in PROMPT_ONLY:
        return prompt, 0
    asked = (
        payload.get("max_completion_tokens")
        or payload.get("max_tokens")
        or payload.get("max_output_tokens")
    )
    output = asked if asked else max(model.context_length - prompt, 16)
    return prompt, output * (payload.get("n") or 1)


def upstream_body(payload: dict, body: bytes, stream: bool, changed: bool = False) -> bytes:
    """The body for the engine (the engine shield has already dropped what it must not
    see): streams report usage continuously. (A copy: ``payload`` keeps what the client
    asked for.)"""
    if not (stream or changed):
        return body
    out = dict(payload)
    if stream:
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return orjson.dumps(out)


def prepare(ex: Exchange, scope: dict) -> tuple[int, int]:
    """What admission decides before it asks Redis: the request's id, price, class and claim
    on an engine slot, and the body its engine gets. Returns the (prompt, output) estimate."""
    rt, payload, tenant, model, upstreams = ex.rt, ex.payload, ex.tenant, ex.model, ex.upstreams
    occurred = ex.occurred = time.time()
    prompt_est, output_est = estimate(ex.body, payload, model, ex.endpoint)
    ex.price = rt.snapshot.price_for(model, tenant.currency, occurred)
    ex.request_id = "req_" + secrets.token_hex(12)
    # The body's "priority" is Tollgate's (a class to lower to); it never reaches an engine
    # as such: engines that schedule by priority get the class as vLLM's integer instead.
    client_priority = payload.pop("priority", None)
    asked = next(
        (v.decode("latin-1") for n, v in scope["headers"] if n == b"x-tollgate-priority"),
        client_priority,
    )
    priority = lowered(tenant.priority_at(occurred), asked)
    # Engines that schedule by priority get the class as vLLM's integer (lower runs
    # first): it orders their waiting queue and picks whom a full KV cache preempts. But a
    # waiting request never takes a running one's slot there (vLLM 0.32;
    # tests/vllm/test_priority.py), so on every engine the slot is the gateway's to give:
    # P0 heads the gateway's queue, or preempts.
    ordered = all(u.priority_scheduling for u in upstreams)
    if ordered:
        payload["priority"] = CLASS_INDEX[priority]
    # Where that frees an engine slot: not on engines that finish what it aborts (the
    # controller's verdict, read with the engine telemetry; the headroom protects P0 there).
    gateway_preempts = preempt.enabled() and rt.admission.preempt_frees.get(model.id, True)
    victim = (
        gateway_preempts
        and priority != "P0"
        and ex.plan is None
        and preempt.preemptible(ex.endpoint, payload)
    )
    changed = ordered or client_priority is not None
    stream_options = payload.get("stream") is True and ex.endpoint in STREAM_OPTIONS
    ex.body = upstream_body(payload, ex.body, stream_options, changed)
    ex.claim = Claim(
        request_id=ex.request_id,
        model_id=model.id,
        # The model's whole pool (an adapter's requests share its base's engine slots).
        budget=sum(u.max_num_seqs for u in rt.snapshot.routes.get(model.id, upstreams)),
        priority=priority,
        tenant_id=tenant.id,
        weight=tenant.weight,
        cost=prompt_est + output_est,
        kv=rt.admission.predicted_tokens(model.id, prompt_est, output_est, model.context_length),
        preempts=gateway_preempts and priority != "P2",
        victim=victim,
    )
    return prompt_est, output_est


def open_record(ex: Exchange) -> dict:
    """The request's record while it is open: what the orphan reaper (gateway/orphans.py)
    needs to settle it should this process die."""
    price = ex.price
    record = {
        "event": {
            "request_id": ex.request_id,
            "occurred_at": ex.occurred,
            "tenant_id": ex.tenant.id,
            "api_key_id": ex.key.id,
            "model_id": ex.model.id,
            "adapter_id": ex.model.adapter_id or None,
            "deployment_id": None,
            "endpoint": ex.endpoint,
            "priority": ex.claim.priority,
            "price_id": price.id if price else None,
        },
        "price": [
            price.input_nano_per_mtok,
            price.cached_nano_per_mtok,
            price.output_nano_per_mtok,
        ]
        if price
        else None,
    }
    # Should this process die once the engine took the request, the reaper bills its
    # prompt from this (gateway/billing.py): part of the admission write, no extra call.
    prompt = billing.orphan_prompt(ex.endpoint, ex.payload, ex.body)
    if prompt is not None:
        record["prompt"] = prompt
    return record


async def admit(ex: Exchange, scope: dict) -> Decision | None:
    """Admit the request (it then holds an engine slot, or is queued for one), or answer the
    client why not (None)."""
    prompt_est, output_est = prepare(ex, scope)
    rt, tenant, request_id = ex.rt, ex.tenant, ex.request_id
    money_est = cost_nano(ex.price, prompt_est, 0, output_est) if ex.price else 0
    slot = rt.admission.slot_request(ex.claim)
    try:
        decision = await rt.limiter.admit(
            request_id, ex.key, tenant, ex.claim.cost, money_est, slot, open_record(ex), ex.occurred
        )
    except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
        log.error(
            "rate-limit store unreachable (%s): refusing request %s",
            exc.__class__.__name__,
            request_id,
        )
        metrics.REJECTIONS.labels(tenant.slug, "redis_down").inc()
        await respond(ex.send, 503, STORE_DOWN, [(b"retry-after", b"5")])
        return None
    if not decision.admitted:
        metrics.REJECTIONS.labels(tenant.slug, decision.reason).inc()
        status, err, headers = refusal(decision, tenant, ex.occurred)
        await respond(ex.send, status, err, headers + [(b"x-request-id", request_id.encode())])
        return None
    return decision


async def wait_for_slot(ex: Exchange) -> Outcome | None:
    """All the model's engine slots are taken: wait for one by priority. None once the
    request holds one; else what became of it (the client left, or was told to retry)."""
    try:
        ticket = await ex.rt.admission.wait(ex.claim, ex.disconnect.event)
    except (redis.exceptions.RedisError, OSError, TimeoutError):
        await respond(ex.send, 503, QUEUE_DOWN, ex.headers + [(b"retry-after", b"5")])
        return Outcome(http_status=503)
    if ticket.admitted:
        return None
    outcome = Outcome(http_status=429)
    if ex.disconnect.event.is_set():
        outcome.status = "client_closed"
        return outcome
    metrics.REJECTIONS.labels(ex.tenant.slug, "queue_timeout").inc()
    await respond(
        ex.send,
        429,
        error_body(
            f"The model `{ex.model.served_name}` is busy: this {ex.claim.priority} request "
            f"waited {ticket.waited:.0f}s for an engine slot. Please retry in "
            f"{ticket.retry_after}s.",
            "requests",
            code="rate_limit_exceeded",
        ),
        ex.headers + [(b"retry-after", str(ticket.retry_after).encode())],
    )
    return outcome
