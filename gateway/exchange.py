"""One request's exchange with an engine: admit, wait for a slot, forward, relay, settle.

gateway/app.py routes, authenticates and validates a request; here it is admitted (one Lua
call: rate limits, concurrency, quota and an engine slot), waits in the priority queue when
the model's engines are busy, goes to the least busy replica (the relay passes the answer
through, gateway/relay.py), and is settled (one Lua call: real usage, release, the usage
record). What a request carries through these steps is one ``Exchange``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import orjson
import redis.exceptions

from core.keyspace import open_keys
from core.pricing import cost_nano
from core.usage import UsageRecord
from gateway import billing, messages, metrics, preempt, responses
from gateway.admission import CLASS_INDEX, Claim, lowered
from gateway.errors import error_body
from gateway.limiter import Decision, Reservation
from gateway.relay import (
    Preempted,
    StreamState,
    UpstreamRefused,
    forward_stream,
    forward_whole,
    respond,
    resume_stream,
)
from gateway.runtime import Runtime
from gateway.state import KeyInfo, ModelInfo, TenantInfo, Upstream
from gateway.usage import USAGE_SHAPES, Outcome, UsageShape, checkpoint_value
from metering.periods import period_end

log = logging.getLogger("tollgate.gateway")

# The engine path of each endpoint (gateway.app.ENDPOINTS maps client paths to endpoints).
UPSTREAM_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "rerank": "/v1/rerank",
    "score": "/v1/score",
    "responses": "/v1/responses",
}
# Endpoints whose streams take OpenAI's stream_options (the gateway asks for running usage).
STREAM_OPTIONS = frozenset(("chat", "completions"))
# Endpoints that generate nothing: no output tokens are reserved.
PROMPT_ONLY = frozenset(("embeddings", "count_tokens", "rerank", "score"))

# Body fields some SDKs and proxies use to redirect or re-authenticate traffic: never honoured.
REDIRECT_FIELDS = (
    "api_base",
    "base_url",
    "api_key",
    "api_version",
    "custom_llm_provider",
    "extra_headers",
    "headers",
    "user_api_key",
)


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
    """The body for the engine: redirect fields removed; streams report usage continuously.
    (A copy: ``payload`` keeps what the client asked for.)"""
    out = dict(payload)
    dirty = changed
    for field in REDIRECT_FIELDS:
        if field in out:
            del out[field]
            dirty = True
    if stream:
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        dirty = True
    return orjson.dumps(out) if dirty else body


class Disconnect:
    """Watches the client connection: sets ``event`` when it goes, and cancels the forwarding
    task (so the engine request is aborted) once forwarding has begun."""

    def __init__(self, receive: Any) -> None:
        self.event = asyncio.Event()
        self.cancel_on: asyncio.Task | None = None
        self._task = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.event.set()
        if self.cancel_on is not None:
            self.cancel_on.cancel()

    def close(self) -> None:
        self._task.cancel()


class Exchange:
    """One authenticated, valid request on its way through an engine: everything admitting,
    queueing, forwarding and settling it need (slots: no per-request ``__dict__``). The
    fields after ``started`` are set by admission."""

    __slots__ = (
        "rt",
        "send",
        "endpoint",
        "payload",
        "body",
        "key",
        "tenant",
        "model",
        "upstreams",
        "started",
        "occurred",
        "request_id",
        "claim",
        "price",
        "headers",
        "disconnect",
        "plan",
        "preemptions",
        "preempted",
        "relay_task",
        "st",
        "outcome",
    )

    def __init__(
        self,
        rt: Runtime,
        send: Any,
        endpoint: str,
        payload: dict,
        body: bytes,
        key: KeyInfo,
        tenant: TenantInfo,
        model: ModelInfo,
        upstreams: list[Upstream],
        started: float,
        plan: responses.ResponsePlan | None = None,
    ) -> None:
        self.rt = rt
        self.send = send
        self.endpoint = endpoint
        self.payload = payload  # what the client asked for
        self.body = body  # the client's body; the engine's once admission rewrote it
        self.key = key
        self.tenant = tenant
        self.model = model
        self.upstreams = upstreams
        self.started = started  # perf_counter() when the request arrived
        self.plan = plan  # /v1/responses: the id it gets and what to keep of it
        self.relay_task: asyncio.Task | None = None  # set while a preemptible one is relayed

    async def admit_and_forward(self, scope: dict, receive: Any) -> None:
        """Admit the request (or answer why not), then serve it and clean up after it."""
        rt, payload, tenant, model, upstreams = (
            self.rt,
            self.payload,
            self.tenant,
            self.model,
            self.upstreams,
        )
        send = self.send
        occurred = self.occurred = time.time()
        prompt_est, output_est = estimate(self.body, payload, model, self.endpoint)
        price = self.price = rt.snapshot.price_at(model.id, tenant.currency, occurred)
        money_est = cost_nano(price, prompt_est, 0, output_est) if price else 0
        request_id = self.request_id = "req_" + secrets.token_hex(12)
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
            and self.plan is None
            and preempt.preemptible(self.endpoint, payload)
        )
        changed = ordered or client_priority is not None
        stream_options = payload.get("stream") is True and self.endpoint in STREAM_OPTIONS
        self.body = upstream_body(payload, self.body, stream_options, changed)
        admission = rt.admission
        tokens = prompt_est + output_est
        self.claim = Claim(
            request_id=request_id,
            model_id=model.id,
            budget=sum(u.max_num_seqs for u in upstreams),
            priority=priority,
            tenant_id=tenant.id,
            weight=tenant.weight,
            cost=tokens,
            kv=admission.predicted_tokens(model.id, prompt_est, output_est, model.context_length),
            preempts=gateway_preempts and priority != "P2",
            victim=victim,
        )
        slot = admission.slot_request(self.claim)
        key = self.key
        record = {
            "event": {
                "request_id": request_id,
                "occurred_at": occurred,
                "tenant_id": tenant.id,
                "api_key_id": key.id,
                "model_id": model.id,
                "deployment_id": None,
                "endpoint": self.endpoint,
                "priority": priority,
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
        prompt = billing.orphan_prompt(self.endpoint, payload, self.body)
        if prompt is not None:
            record["prompt"] = prompt
        try:
            decision = await rt.limiter.admit(
                request_id, key, tenant, tokens, money_est, slot, record, occurred
            )
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            log.error(
                "rate-limit store unreachable (%s): refusing request %s",
                exc.__class__.__name__,
                request_id,
            )
            metrics.REJECTIONS.labels(tenant.slug, "redis_down").inc()
            return await respond(
                send,
                503,
                error_body(
                    "Tollgate cannot reach its rate-limit store, so it cannot admit requests right "
                    "now. Please retry shortly.",
                    "server_error",
                    code="service_unavailable",
                ),
                [(b"retry-after", b"5")],
            )
        if not decision.admitted:
            metrics.REJECTIONS.labels(tenant.slug, decision.reason).inc()
            status, err, headers = refusal(decision, tenant, occurred)
            return await respond(
                send, status, err, headers + [(b"x-request-id", request_id.encode())]
            )
        rt.used_keys.add(key.id)
        rt.open_requests.add(request_id)
        self.headers = ratelimit_headers(decision) + [
            (b"x-request-id", request_id.encode()),
            (b"x-tollgate-priority", priority.encode()),
        ]
        disconnect = self.disconnect = Disconnect(receive)
        if victim:
            self.preemptions, self.preempted, self.st = 0, False, None
            rt.preemptible[request_id] = self
        try:
            await self.serve(decision)
        finally:
            if victim:
                rt.preemptible.pop(request_id, None)
            disconnect.close()
            # Settled, or else left on record for the reaper (its lease lapses once we stop
            # renewing it).
            rt.open_requests.discard(request_id)
            rt.admission.running.pop(request_id, None)

    async def serve(self, decision: Decision) -> None:
        """Forward now (admission gave it a slot) or after queueing for one; then settle."""
        admission, request_id, model_id = self.rt.admission, self.request_id, self.model.id
        if decision.slot:
            admission.holding(request_id, model_id)
            outcome, upstream = await self.forward()
        else:
            outcome, upstream = await self.queue_then_forward()
        admission.finished(
            request_id, model_id, time.perf_counter() - self.started, outcome.completion_tokens
        )
        await self.settle(decision.reservation, outcome, upstream)

    async def queue_then_forward(self) -> tuple[Outcome, Upstream | None]:
        """All the model's engine slots are taken: wait for one by priority, then forward."""
        send, tenant, model, priority, disconnect = (
            self.send,
            self.tenant,
            self.model,
            self.claim.priority,
            self.disconnect,
        )
        try:
            ticket = await self.rt.admission.wait(self.claim, disconnect.event)
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            await respond(
                send,
                503,
                error_body(
                    "Tollgate cannot reach its admission queue right now. Please retry shortly.",
                    "server_error",
                    code="service_unavailable",
                ),
                self.headers + [(b"retry-after", b"5")],
            )
            return Outcome(http_status=503), None
        if not ticket.admitted:
            outcome = Outcome(http_status=429)
            if disconnect.event.is_set():
                outcome.status = "client_closed"
                return outcome, None
            metrics.REJECTIONS.labels(tenant.slug, "queue_timeout").inc()
            await respond(
                send,
                429,
                error_body(
                    f"The model `{model.served_name}` is busy: this {priority} request waited "
                    f"{ticket.waited:.0f}s for an engine slot. Please retry in "
                    f"{ticket.retry_after}s.",
                    "requests",
                    code="rate_limit_exceeded",
                ),
                self.headers + [(b"retry-after", str(ticket.retry_after).encode())],
            )
            return outcome, None
        return await self.forward()

    async def forward(self) -> tuple[Outcome, Upstream | None]:
        """Send the request to the replica routing picks (gateway/routing.py; the next one if
        it refuses the connection) and pass its answer to the client."""
        rt, payload, send, headers, disconnect = (
            self.rt,
            self.payload,
            self.send,
            self.headers,
            self.disconnect,
        )
        endpoint = self.endpoint
        stream = payload.get("stream") is True and endpoint not in PROMPT_ONLY
        outcome = Outcome()
        st = None
        if stream:
            options = payload.get("stream_options") or {}
            wants_usage = bool(options.get("include_usage"))
            st = StreamState(
                wants_usage=wants_usage,
                wants_continuous=wants_usage and bool(options.get("continuous_usage_stats")),
                started_at=self.started,
                outcome=outcome,
                checkpoint=self.checkpoint,
                # The first checkpoint after a second: not in the way of the first token.
                last_checkpoint=time.monotonic(),
            )
            if endpoint == "messages":
                st.transform, st.error_frames = messages.transform_event, messages.stream_error
        answer = None
        if self.plan is not None:
            dialect = responses.ResponseRelay(self.plan, rt.responses)
            if st is not None:
                dialect.attach(st)
            answer = dialect.answer
        shape = USAGE_SHAPES[endpoint]
        path = UPSTREAM_PATHS[endpoint]
        up_headers = {"content-type": "application/json", "x-request-id": self.request_id}
        task = asyncio.current_task()
        disconnect.cancel_on = task
        if disconnect.event.is_set():
            outcome.status = "client_closed"
            return outcome, None
        chosen = None
        model_name = payload["model"]
        try:
            replicas = self.upstreams
            if len(replicas) > 1:
                replicas = await rt.router.order(self.model.id, endpoint, payload, replicas)
            for upstream in replicas:
                chosen = upstream
                upstream.outstanding += 1
                metrics.in_flight[model_name] += 1
                try:
                    outcome.forwarded = True
                    url = upstream.base_url + path
                    sent_headers = up_headers
                    if upstream.auth_header:
                        sent_headers = {**up_headers, "authorization": upstream.auth_header}
                    if self.claim.victim:
                        await self.relay_preemptible(
                            upstream, url, sent_headers, stream, st, outcome, shape
                        )
                    elif stream:
                        await forward_stream(
                            rt.session,
                            url,
                            self.body,
                            sent_headers,
                            send,
                            headers,
                            st,
                            rt.max_frame,
                        )
                    else:
                        await forward_whole(
                            rt.session,
                            url,
                            self.body,
                            sent_headers,
                            send,
                            headers,
                            outcome,
                            shape,
                            answer,
                        )
                    break
                except UpstreamRefused:
                    outcome.forwarded = False
                    metrics.UPSTREAM_ERRORS.labels(model_name, "refused").inc()
                    continue  # nothing was sent yet: try the next replica
                finally:
                    upstream.outstanding -= 1
                    metrics.in_flight[model_name] -= 1
            else:
                await respond(
                    send,
                    503,
                    error_body(
                        "No engine for this model accepted the connection. Please retry shortly.",
                        "server_error",
                        code="model_not_ready",
                    ),
                    headers + [(b"retry-after", b"5")],
                )
                outcome.http_status = 503
        except asyncio.CancelledError:
            if not disconnect.event.is_set():
                raise
            task.uncancel()
            outcome.status = "client_closed"
            if not stream:
                outcome.completion_tokens = 0  # the answer never reached the client
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-request
            metrics.UPSTREAM_ERRORS.labels(model_name, exc.__class__.__name__).inc()
            outcome.status = "error"
            if not outcome.started:
                outcome.http_status = 502
                await respond(
                    send,
                    502,
                    error_body("The engine failed while answering. Please retry.", "server_error"),
                    headers,
                )
            elif st is not None:
                failed = st.failure("The engine failed while answering.")
                await send({"type": "http.response.body", "body": failed})
        finally:
            disconnect.cancel_on = None
        return outcome, chosen

    def on_preempt(self) -> None:
        """Admission gave this request's slot to a higher class: abort it upstream (closing
        the connection frees the engine's slot), unless a send to the client is under way
        (the relay stops after it) or the answer is already complete."""
        self.preempted = True
        task, st = self.relay_task, self.st
        if task is None:
            return  # not relaying: relay_preemptible sees the flag before it forwards
        if st is not None:
            if st.sending:
                st.preempt = True
                return
        elif self.outcome.started:
            return  # the whole answer is in hand: it goes to the client
        task.cancel()

    async def relay_preemptible(
        self,
        upstream: Upstream,
        url: str,
        up_headers: dict[str, str],
        stream: bool,
        st: StreamState | None,
        outcome: Outcome,
        shape: UsageShape,
    ) -> None:
        """Relay a request the gateway may preempt; when it is, queue it again at the head
        of its class and resume it once readmitted (gateway/preempt.py)."""
        rt, send, body = self.rt, self.send, self.body
        task = asyncio.current_task()
        self.st, self.outcome = st, outcome
        if st is not None:
            st.sent = []
        resumed = False
        while True:
            if not self.preempted:
                self.relay_task = task
                try:
                    if resumed:
                        await resume_stream(
                            rt.session, url, body, up_headers, send, st, rt.max_frame
                        )
                    elif stream:
                        await forward_stream(
                            rt.session, url, body, up_headers, send, self.headers, st, rt.max_frame
                        )
                    else:
                        await forward_whole(
                            rt.session, url, body, up_headers, send, self.headers, outcome, shape
                        )
                    return
                except asyncio.CancelledError:
                    if not self.preempted or self.disconnect.event.is_set():
                        raise
                    task.uncancel()
                except Preempted:
                    pass
                except UpstreamRefused as exc:
                    if not resumed:
                        raise  # nothing was sent yet: forward tries the next replica
                    raise RuntimeError("the engine refused the resumed request") from exc
                finally:
                    self.relay_task = None
            self.preempted = False
            self.preemptions += 1
            metrics.PREEMPTIONS.labels(self.model.served_name, self.claim.priority).inc()
            if stream and outcome.started:
                st.preempt = False
                text, ident, created = preempt.delivered(st, self.endpoint)
                emitted = outcome.completion_tokens
                if text and not outcome.prompt_known:  # the engine sends usage only at the end
                    await billing.count_prompt(
                        rt.session, self.endpoint, self.payload, outcome, upstream, self.upstreams
                    )
                prompt = outcome.prompt_tokens if outcome.prompt_tokens else None
                again = preempt.resumed_payload(self.payload, self.endpoint, text, emitted)
                body = upstream_body(again, b"", True, True)
                st.transform = preempt.resumed_transform(
                    st, self.endpoint, ident, created, prompt, emitted
                )
                resumed = True
            if not await self.readmit(stream, outcome):
                return

    async def readmit(self, stream: bool, outcome: Outcome) -> bool:
        """Queue a preempted request at the head of its class until a slot frees; False
        (and the client told, unless it left) when it may not wait any longer."""
        disconnect, task = self.disconnect, self.disconnect.cancel_on
        disconnect.cancel_on = None  # a client leaving now ends the wait (which cleans up)
        try:
            # At the head of its class; preempted at most so many times.
            victim = preempt.may_be_victim(self.preemptions)
            claim = replace(self.claim, victim=victim, head=True)
            ticket = await self.rt.admission.wait(claim, disconnect.event)
        finally:
            disconnect.cancel_on = task
        if ticket.admitted:
            return True
        if disconnect.event.is_set():
            outcome.status = "client_closed"
            if not stream:
                outcome.completion_tokens = 0
            return False
        message = (
            f"The model `{self.model.served_name}` is busy: this {self.claim.priority} request was "
            f"paused for a higher class and waited {ticket.waited:.0f}s to resume."
        )
        outcome.status = "error"
        if stream and outcome.started:
            failed = self.st.failure(message)
            await self.send({"type": "http.response.body", "body": failed, "more_body": False})
        else:
            outcome.http_status = 429
            await respond(
                self.send,
                429,
                error_body(message, "requests", code="rate_limit_exceeded"),
                self.headers + [(b"retry-after", str(ticket.retry_after).encode())],
            )
        return False

    async def checkpoint(self, o: Outcome) -> None:
        """Record a stream's delivered tokens (about once a second) for the orphan reaper."""
        value = checkpoint_value(
            o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.reasoning_tokens
        )
        try:
            async with asyncio.timeout(1.0):
                await self.rt.pipe.call(b"HSET", open_keys()[2], self.request_id, value)
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            pass  # the final settle carries the exact figures; this only covers a crash

    async def settle(
        self, reservation: Reservation, outcome: Outcome, upstream: Upstream | None
    ) -> None:
        """Bill what was delivered, release the reservation and the slot, record the usage."""
        billable = billing.billable(self.endpoint, outcome)
        if billable and not outcome.prompt_known and self.endpoint in billing.PROMPT_COUNTS:
            await billing.count_prompt(
                self.rt.session, self.endpoint, self.payload, outcome, upstream, self.upstreams
            )
        if not billable:
            outcome.prompt_tokens = outcome.cached_tokens = outcome.completion_tokens = (
                outcome.reasoning_tokens
            ) = 0
        tokens = outcome.prompt_tokens + outcome.completion_tokens
        price, tenant, model = self.price, self.tenant, self.model
        money = 0
        if price and tokens:
            money = cost_nano(
                price, outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens
            )
        latency = time.perf_counter() - self.started
        record = UsageRecord(
            request_id=self.request_id,
            occurred_at=self.occurred,
            tenant_id=tenant.id,
            api_key_id=self.key.id,
            model_id=model.id,
            deployment_id=upstream.deployment_id if upstream else None,
            endpoint=self.endpoint,
            priority=self.claim.priority,
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
        )
        await self.rt.settle(reservation, tokens, money, record.encode(), model.id)
        metrics.request_done(
            tenant.slug,
            model.served_name,
            self.endpoint,
            outcome.status,
            latency,
            None if outcome.ttft_ms is None else outcome.ttft_ms / 1000,
            outcome.prompt_tokens,
            outcome.completion_tokens,
        )
