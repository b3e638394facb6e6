"""The OpenAI-compatible ``/v1`` gateway: a bare ASGI application on the hot path.

Per request: authenticate from cache, resolve the model and a replica from cache, one Lua
call to admit (rate limits, concurrency, quota), forward over a pooled keep-alive connection,
one Lua call to settle (real usage, release, usage event). No ORM, no Django request
machinery.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import Any

import orjson
import redis.exceptions
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from gateway import metrics
from gateway.admission import CLASS_INDEX, lowered
from gateway.errors import INVALID_KEY, error_body, model_not_found
from gateway.limiter import Decision, Reservation
from gateway.orphans import checkpoint_value, open_keys
from gateway.relay import (
    JSON_HEADERS,
    Outcome,
    StreamState,
    UpstreamRefused,
    forward_stream,
    forward_whole,
)
from gateway.runtime import Runtime
from gateway.state import KeyInfo, ModelInfo, TenantInfo, Upstream
from metering.events import UsageRecord
from tenants.keys import parse_key, verify_key

log = logging.getLogger("tollgate.gateway")

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
# Body fields some SDKs and proxies use to redirect or re-authenticate traffic: never honoured.
REDIRECT_FIELDS = ("api_base", "base_url", "api_key", "api_version", "custom_llm_provider",
                   "extra_headers", "headers", "user_api_key")
MAX_PRESENTED_KEY = 256


async def read_body(receive: Any, limit: int) -> bytes | None:
    """The request body, or None when it is larger than ``limit``."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + (headers or [])})
    await send({"type": "http.response.body", "body": body})


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


def refusal(decision: Decision) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The 429 for a refused admission, with Retry-After where waiting helps."""
    headers = ratelimit_headers(decision)
    reason, scope = decision.reason, decision.scope
    if reason in ("quota_tokens", "quota_money"):
        what = "token" if reason == "quota_tokens" else "spending"
        body = error_body(
            f"You exceeded your tenant's {what} quota for this period. Ask your tenant admin to "
            "raise it, or wait for the next period.", "insufficient_quota", code="insufficient_quota")
        return 429, body, headers
    if reason == "too_large":
        body = error_body(
            f"Request too large: it may use more tokens than the {scope}'s tokens-per-minute limit "
            f"of {decision.limit_tokens}. Lower max_tokens or shorten the prompt.",
            "tokens", code="rate_limit_exceeded")
        return 429, body, headers
    wait_s = max(decision.retry_ms, 1) / 1000
    label = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)",
             "concurrency": "concurrent requests"}[reason]
    body = error_body(
        f"Rate limit reached for {label} on this {scope}. Please try again in {wait_s:.3g}s.",
        "tokens" if reason == "tokens" else "requests", code="rate_limit_exceeded")
    headers += [(b"retry-after", str(max(1, -(-decision.retry_ms // 1000))).encode()),
                (b"retry-after-ms", str(max(decision.retry_ms, 1)).encode())]
    return 429, body, headers


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


class Gateway:
    """The ASGI callable for ``/v1/…`` and the gateway's ``/metrics``."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.rt = runtime or Runtime()
        self.max_body = settings.TOLLGATE_MAX_BODY_BYTES
        self.max_n = settings.TOLLGATE_MAX_N
        self.max_frame = settings.TOLLGATE_MAX_SSE_FRAME_BYTES
        self.allowed_hosts = list(settings.ALLOWED_HOSTS)
        if settings.DEBUG and not self.allowed_hosts:
            self.allowed_hosts = [".localhost", "127.0.0.1", "[::1]"]  # as Django does
        self._hosts: dict[bytes, bool] = {}

    @staticmethod
    def handles(path: str) -> bool:
        return path in ENDPOINTS or path == "/v1/models" or path.startswith("/v1/models/") or path == "/metrics"

    async def startup(self) -> None:
        await self.rt.start()

    async def shutdown(self) -> None:
        await self.rt.stop()

    def host_allowed(self, scope: dict) -> bool:
        """Django's ALLOWED_HOSTS rule, applied to /v1 too (cached per Host value)."""
        host = next((v for n, v in scope["headers"] if n == b"host"), b"")
        verdict = self._hosts.get(host)
        if verdict is None:
            name, _ = split_domain_port(host.decode("latin-1").lower())
            verdict = bool(name) and validate_host(name, self.allowed_hosts)
            if len(self._hosts) < 1024:
                self._hosts[host] = verdict
        return verdict

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        if not self.host_allowed(scope):
            return await respond(send, 400, error_body("Invalid Host header."))
        if path == "/metrics":
            return await self.serve_metrics(scope, send)
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method != "GET":
                return await respond(send, 405, error_body(f"Method {method} is not allowed on {path}."))
            return await self.list_models(scope, send, path)
        if method != "POST":
            return await respond(send, 405, error_body(f"Method {method} is not allowed on {path}."))
        try:
            await self.generate(scope, receive, send, ENDPOINTS[path])
        except ConnectionAbortedError:
            return

    # --- Authentication --------------------------------------------------------------------

    def authenticate(self, scope: dict) -> tuple[KeyInfo, TenantInfo] | None:
        """The key and tenant for the request's credentials; the same work for every failure."""
        presented = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    presented = token.strip()
            elif name == b"api-key" and not presented:
                presented = value.decode("latin-1").strip()
        presented = presented[:MAX_PRESENTED_KEY]
        snap = self.rt.snapshot
        prefix = parse_key(presented)
        key = snap.keys.get(prefix) if prefix else None
        valid = verify_key(presented, key.secret_hash if key else None)
        if not valid or (key.expires_at and key.expires_at <= time.time()):
            return None
        tenant = snap.tenants.get(key.tenant_id)
        if tenant is None or not tenant.active:
            return None
        return key, tenant

    def allowed(self, key: KeyInfo, tenant: TenantInfo, model: ModelInfo | None) -> bool:
        if model is None or model.id not in tenant.model_ids:
            return False
        return not key.model_ids or model.id in key.model_ids

    # --- /v1/models --------------------------------------------------------------------------

    async def list_models(self, scope: dict, send: Any, path: str) -> None:
        auth = self.authenticate(scope)
        if auth is None:
            return await respond(send, 401, INVALID_KEY)
        key, tenant = auth
        cards = [
            {"id": m.served_name, "object": "model", "created": m.created, "owned_by": "tollgate"}
            for m in sorted(self.rt.snapshot.models.values(), key=lambda m: m.served_name)
            if self.allowed(key, tenant, m)
        ]
        if path == "/v1/models":
            return await respond(send, 200, orjson.dumps({"object": "list", "data": cards}))
        wanted = path.removeprefix("/v1/models/")
        card = next((c for c in cards if c["id"] == wanted), None)
        if card is None:
            return await respond(send, 404, model_not_found(wanted))
        await respond(send, 200, orjson.dumps(card))

    # --- /metrics ------------------------------------------------------------------------------

    async def serve_metrics(self, scope: dict, send: Any) -> None:
        token = settings.TOLLGATE_METRICS_TOKEN
        presented = next((v.decode("latin-1") for n, v in scope["headers"] if n == b"authorization"), "")
        if not token or not hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
            return await respond(send, 404, error_body("Not found."))
        body, content_type = metrics.render()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type.encode())]})
        await send({"type": "http.response.body", "body": body})

    # --- Generation ----------------------------------------------------------------------------

    async def generate(self, scope: dict, receive: Any, send: Any, endpoint: str) -> None:
        started = time.perf_counter()
        body = await read_body(receive, self.max_body)
        if body is None:
            return await respond(send, 413, error_body(
                f"The request body is larger than {self.max_body} bytes."))
        auth = self.authenticate(scope)
        if auth is None:
            return await respond(send, 401, INVALID_KEY)
        key, tenant = auth
        payload, problem = self.parse(body, endpoint)
        if problem:
            return await respond(send, *problem)
        model = self.rt.snapshot.models.get(payload["model"])
        if not self.allowed(key, tenant, model):
            return await respond(send, 404, model_not_found(payload["model"]))
        problem = self.check_request(payload, model, endpoint)
        if problem:
            return await respond(send, *problem)
        upstreams = self.rt.snapshot.routes.get(model.id)
        if not upstreams:
            metrics.REJECTIONS.labels(tenant.slug, "no_replica").inc()
            return await respond(send, 503, error_body(
                f"The model `{model.served_name}` has no engine ready to serve it. Please retry shortly.",
                "server_error", code="model_not_ready"), [(b"retry-after", b"10")])
        await self.admit_and_forward(scope, receive, send, endpoint, body, payload, key, tenant, model,
                                     upstreams, started)

    def parse(self, body: bytes, endpoint: str) -> tuple[dict, tuple | None]:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {}, (400, error_body(
                "We could not parse the JSON body of your request. Send valid JSON with "
                "Content-Type: application/json."))
        if not isinstance(payload, dict):
            return {}, (400, error_body("The request body must be a JSON object."))
        if not isinstance(payload.get("model"), str) or not payload["model"]:
            return {}, (400, error_body("You must provide a model parameter.", param="model"))
        return payload, None

    def check_request(self, payload: dict, model: ModelInfo, endpoint: str) -> tuple | None:
        wants_embed = endpoint == "embeddings"
        if wants_embed != (model.task == "embed"):
            kind = "an embedding" if model.task == "embed" else "a chat/completion"
            return 400, error_body(
                f"`{model.served_name}` is {kind} model and is not supported on /v1/{endpoint.replace('chat', 'chat/completions')}.",
                param="model", code="model_not_supported")
        n = payload.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.max_n):
            return 400, error_body(f"n must be a whole number from 1 to {self.max_n}.", param="n")
        for field in ("max_tokens", "max_completion_tokens"):
            value = payload.get(field)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= model.context_length:
                return 400, error_body(
                    f"{field} must be a whole number from 1 to {model.context_length} "
                    f"(the model's context length).", param=field)
        if payload.get("stream_options") is not None and payload.get("stream") is not True:
            return 400, error_body("stream_options is only allowed when stream is true.", param="stream_options")
        return None

    def estimate(self, body: bytes, payload: dict, model: ModelInfo, endpoint: str) -> tuple[int, int]:
        """(prompt, output) token reservation. ~4 bytes a token overestimates real prompts."""
        prompt = len(body) // 4 + 8
        if endpoint == "embeddings":
            return prompt, 0
        asked = payload.get("max_completion_tokens") or payload.get("max_tokens")
        output = asked if asked else max(model.context_length - prompt, 16)
        return prompt, output * (payload.get("n") or 1)

    async def admit_and_forward(
        self, scope: dict, receive: Any, send: Any, endpoint: str, body: bytes, payload: dict,
        key: KeyInfo, tenant: TenantInfo, model: ModelInfo, upstreams: list[Upstream], started: float,
    ) -> None:
        occurred = time.time()
        prompt_est, output_est = self.estimate(body, payload, model, endpoint)
        price = self.rt.snapshot.price_at(model.id, tenant.currency, occurred)
        money_est = 0
        if price:
            money_est = -(-(prompt_est * price.input_nano_per_mtok + output_est * price.output_nano_per_mtok) // 1_000_000)
        request_id = "req_" + secrets.token_hex(12)
        # The body's "priority" is Tollgate's (a class to lower to); it never reaches an engine
        # as such: engines that schedule by priority get the class as vLLM's integer instead.
        client_priority = payload.pop("priority", None)
        asked = next((v.decode("latin-1") for n, v in scope["headers"] if n == b"x-tollgate-priority"),
                     client_priority)
        priority = lowered(tenant.priority_at(occurred), asked)
        budget = sum(u.max_num_seqs for u in upstreams)
        # Engines that schedule by priority preempt lower classes themselves: P0 may go past
        # the ceiling (up to twice the budget) instead of waiting for a P2 request to finish.
        preempts = all(u.priority_scheduling for u in upstreams)
        p0_extra = budget if preempts else 0
        if preempts:
            payload["priority"] = CLASS_INDEX[priority]  # vLLM's integer: lower runs first
        changed = preempts or client_priority is not None
        body = self.upstream_body(payload, body, payload.get("stream") is True, changed)
        admission = self.rt.admission
        slot = admission.slot_request(model.id, budget, priority, tenant.weight, p0_extra)
        record = {
            "event": {"request_id": request_id, "occurred_at": occurred, "tenant_id": tenant.id,
                      "api_key_id": key.id, "model_id": model.id, "deployment_id": None,
                      "endpoint": endpoint, "priority": priority, "price_id": price.id if price else None},
            "price": [price.input_nano_per_mtok, price.cached_nano_per_mtok, price.output_nano_per_mtok]
            if price else None,
        }
        try:
            decision = await self.rt.limiter.admit(
                request_id, key, tenant, prompt_est + output_est, money_est, slot, record, occurred)
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            log.error("rate-limit store unreachable (%s): refusing request %s", exc.__class__.__name__, request_id)
            metrics.REJECTIONS.labels(tenant.slug, "redis_down").inc()
            return await respond(send, 503, error_body(
                "Tollgate cannot reach its rate-limit store, so it cannot admit requests right now. "
                "Please retry shortly.", "server_error", code="service_unavailable"), [(b"retry-after", b"5")])
        if not decision.admitted:
            metrics.REJECTIONS.labels(tenant.slug, decision.reason).inc()
            status, err, headers = refusal(decision)
            return await respond(send, status, err, headers + [(b"x-request-id", request_id.encode())])
        self.rt.used_keys.add(key.id)
        self.rt.open_requests.add(request_id)
        headers = ratelimit_headers(decision) + [
            (b"x-request-id", request_id.encode()), (b"x-tollgate-priority", priority.encode())]
        disconnect = Disconnect(receive)
        try:
            await self.serve_admitted(send, endpoint, payload, body, request_id, key, tenant, model, upstreams,
                                      headers, started, occurred, prompt_est + output_est, priority, budget,
                                      decision, price, disconnect)
        finally:
            disconnect.close()
            # Settled, or else left on record for the reaper (its lease lapses once we stop renewing).
            self.rt.open_requests.discard(request_id)
            self.rt.admission.running.pop(request_id, None)

    async def serve_admitted(
        self, send: Any, endpoint: str, payload: dict, body: bytes, request_id: str, key: KeyInfo,
        tenant: TenantInfo, model: ModelInfo, upstreams: list[Upstream], headers: list, started: float,
        occurred: float, cost: int, priority: str, budget: int, decision: Decision, price: Any,
        disconnect: Disconnect, p0_extra: int = 0,
    ) -> None:
        admission = self.rt.admission
        if decision.slot:
            admission.holding(request_id, model.id)
            outcome, upstream = await self.forward(
                send, endpoint, payload, body, request_id, upstreams, headers, started, disconnect)
        else:
            outcome, upstream = await self.queue_then_forward(
                send, endpoint, payload, body, request_id, tenant, model, upstreams, headers,
                started, cost, priority, budget, disconnect, p0_extra)
        admission.finished(request_id, model.id, time.perf_counter() - started)
        await self.settle(decision.reservation, outcome, price, key, tenant, model, upstream,
                          endpoint, request_id, occurred, started, priority)

    async def queue_then_forward(
        self, send: Any, endpoint: str, payload: dict, body: bytes, request_id: str,
        tenant: TenantInfo, model: ModelInfo, upstreams: list[Upstream],
        headers: list[tuple[bytes, bytes]], started: float, cost: int, priority: str, budget: int,
        disconnect: Disconnect, p0_extra: int = 0,
    ) -> tuple[Outcome, Upstream | None]:
        """All the model's engine slots are taken: wait for one by priority, then forward."""
        try:
            ticket = await self.rt.admission.wait(
                model.id, budget, request_id, priority, tenant.id, tenant.weight, cost, disconnect.event,
                p0_extra)
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            await respond(send, 503, error_body(
                "Tollgate cannot reach its admission queue right now. Please retry shortly.",
                "server_error", code="service_unavailable"), headers + [(b"retry-after", b"5")])
            return Outcome(http_status=503), None
        if not ticket.admitted:
            outcome = Outcome(http_status=429)
            if disconnect.event.is_set():
                outcome.status = "client_closed"
                return outcome, None
            metrics.REJECTIONS.labels(tenant.slug, "queue_timeout").inc()
            await respond(send, 429, error_body(
                f"The model `{model.served_name}` is busy: this {priority} request waited "
                f"{ticket.waited:.0f}s for an engine slot. Please retry in {ticket.retry_after}s.",
                "requests", code="rate_limit_exceeded"),
                headers + [(b"retry-after", str(ticket.retry_after).encode())])
            return outcome, None
        return await self.forward(send, endpoint, payload, body, request_id, upstreams, headers,
                                  started, disconnect)

    async def forward(
        self, send: Any, endpoint: str, payload: dict, body: bytes, request_id: str,
        upstreams: list[Upstream], headers: list[tuple[bytes, bytes]], started: float,
        disconnect: Disconnect,
    ) -> tuple[Outcome, Upstream | None]:
        stream = payload.get("stream") is True
        options = payload.get("stream_options") or {}
        st = StreamState(
            wants_usage=bool(options.get("include_usage")),
            wants_continuous=bool(options.get("include_usage") and options.get("continuous_usage_stats")),
            started_at=started, outcome=Outcome(), checkpoint=self.checkpointer(request_id),
            last_checkpoint=time.monotonic(),  # the first after a second: not in the way of the first token
        )
        out_body = body  # already the engine's body (see upstream_body)
        path = "/v1/chat/completions" if endpoint == "chat" else f"/v1/{endpoint}"
        up_headers = {"content-type": "application/json", "x-request-id": request_id}
        task = asyncio.current_task()
        disconnect.cancel_on = task
        if disconnect.event.is_set():
            st.outcome.status = "client_closed"
            return st.outcome, None
        chosen = None
        model_name = payload["model"]
        try:
            for upstream in sorted(upstreams, key=lambda u: u.outstanding):
                chosen = upstream
                upstream.outstanding += 1
                metrics.in_flight[model_name] += 1
                try:
                    url = upstream.base_url + path
                    sent_headers = up_headers
                    if upstream.auth_header:
                        sent_headers = {**up_headers, "authorization": upstream.auth_header}
                    if stream:
                        await forward_stream(self.rt.session, url, out_body, sent_headers, send, headers, st, self.max_frame)
                    else:
                        await forward_whole(self.rt.session, url, out_body, sent_headers, send, headers, st.outcome)
                    break
                except UpstreamRefused:
                    metrics.UPSTREAM_ERRORS.labels(payload["model"], "refused").inc()
                    continue  # nothing was sent yet: try the next replica
                finally:
                    upstream.outstanding -= 1
                    metrics.in_flight[model_name] -= 1
            else:
                await respond(send, 503, error_body(
                    "No engine for this model accepted the connection. Please retry shortly.",
                    "server_error", code="model_not_ready"), headers + [(b"retry-after", b"5")])
                st.outcome.http_status = 503
        except asyncio.CancelledError:
            if not disconnect.event.is_set():
                raise
            task.uncancel()
            st.outcome.status = "client_closed"
            if not stream:
                st.outcome.completion_tokens = 0  # the answer never reached the client
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-request
            metrics.UPSTREAM_ERRORS.labels(payload["model"], exc.__class__.__name__).inc()
            st.outcome.status = "error"
            if not st.outcome.started:
                st.outcome.http_status = 502
                await respond(send, 502, error_body(
                    "The engine failed while answering. Please retry.", "server_error"), headers)
            else:
                await send({"type": "http.response.body", "body": b"data: " + error_body(
                    "The engine failed while answering.", "server_error") + b"\n\ndata: [DONE]\n\n"})
        finally:
            disconnect.cancel_on = None
        return st.outcome, chosen

    def checkpointer(self, request_id: str) -> Any:
        """Records a stream's delivered tokens (about once a second) for the orphan reaper."""
        cp_key = open_keys()[2]

        async def checkpoint(o: Outcome) -> None:
            value = checkpoint_value(o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.reasoning_tokens)
            try:
                async with asyncio.timeout(1.0):
                    await self.rt.pipe.call(b"HSET", cp_key, request_id, value)
            except (redis.exceptions.RedisError, OSError, TimeoutError):
                pass  # the final settle carries the exact figures; this only covers a crash

        return checkpoint

    @staticmethod
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

    async def settle(
        self, reservation: Reservation, outcome: Outcome, price: Any, key: KeyInfo, tenant: TenantInfo,
        model: ModelInfo, upstream: Upstream | None, endpoint: str, request_id: str, occurred: float,
        started: float, priority: str,
    ) -> None:
        # Delivered tokens are billed however the request ended; nothing else is.
        billable = outcome.status == "ok" or outcome.completion_tokens > 0
        if not billable:
            outcome.prompt_tokens = outcome.cached_tokens = outcome.completion_tokens = outcome.reasoning_tokens = 0
        tokens = outcome.prompt_tokens + outcome.completion_tokens
        money = 0
        if price and tokens:
            uncached = max(outcome.prompt_tokens - outcome.cached_tokens, 0)
            money = -(-(uncached * price.input_nano_per_mtok + outcome.cached_tokens * price.cached_nano_per_mtok
                        + outcome.completion_tokens * price.output_nano_per_mtok) // 1_000_000)
        latency = time.perf_counter() - started
        record = UsageRecord(
            request_id=request_id, occurred_at=occurred, tenant_id=tenant.id, api_key_id=key.id,
            model_id=model.id, deployment_id=upstream.deployment_id if upstream else None,
            endpoint=endpoint, priority=priority, prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens, completion_tokens=outcome.completion_tokens,
            reasoning_tokens=outcome.reasoning_tokens, status=outcome.status,
            http_status=outcome.http_status or 499, latency_ms=int(latency * 1000),
            ttft_ms=outcome.ttft_ms, price_id=price.id if price else None,
        )
        await self.rt.settle(reservation, tokens, money, record.encode(), model.id)
        metrics.request_done(tenant.slug, model.served_name, endpoint, outcome.status, latency,
                             None if outcome.ttft_ms is None else outcome.ttft_ms / 1000,
                             outcome.prompt_tokens, outcome.completion_tokens)
