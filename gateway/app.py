"""The OpenAI-compatible ``/v1`` gateway: a bare ASGI application on the hot path.

Here: the ASGI entry, routing, authentication and request checks, from cached state. An
accepted request then goes through gateway/serving.py's steps: one Lua call to admit
(admit.py: rate limits, concurrency, quota; then the queue), forwarding over a pooled
keep-alive connection (forwarding.py, preemptible.py), one Lua call to settle (settling.py:
real usage, release, usage event); exchange.py holds the request's record. No ORM, no
Django request machinery.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import orjson
import redis.exceptions
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from core.credentials import INVALID_KEY, presented_key, unexpired
from core.keyspace import demand_stats_key, engine_ledger_stats_key
from gateway import metrics, responses, shield
from gateway.errors import error_body, model_not_found
from gateway.exchange import Exchange
from gateway.messages import AnthropicSend
from gateway.relay import respond
from gateway.runtime import Runtime
from gateway.serving import admit_and_forward
from gateway.state import DemandInfo, KeyInfo, ModelInfo, TenantInfo, Upstream
from tenants.keys import parse_key, verify_key

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/rerank": "rerank",
    "/v1/score": "score",
    "/v1/responses": "responses",
}
# The model task (deployments.choices.Task) each endpoint needs, and how its error names it.
ENDPOINT_TASKS = {
    "chat": "generate",
    "completions": "generate",
    "messages": "generate",
    "count_tokens": "generate",
    "embeddings": "embed",
    "rerank": "score",
    "score": "score",
    "responses": "generate",
}
TASK_KINDS = {"generate": "a chat/completion", "embed": "an embedding", "score": "a rerank/score"}
# Endpoints that answer in Anthropic's dialect (errors included).
ANTHROPIC = frozenset(("messages", "count_tokens"))
# /v1 paths the Django application serves (files, batches, usage); every other /v1 path is
# the gateway's, which answers unknown ones with OpenAI's JSON 404.
DJANGO_V1 = ("/v1/usage", "/v1/files", "/v1/batches")


STORE_DOWN = error_body(
    "Tollgate cannot reach its response store right now. Please retry shortly.",
    "server_error",
    code="service_unavailable",
)


def invalid_url(method: str, path: str) -> bytes:
    """OpenAI's answer for a path it does not serve."""
    return error_body(f"Invalid URL ({method} {path})")


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


class Gateway:
    """The ASGI callable for ``/v1/…`` and the gateway's ``/metrics``."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self.rt = runtime or Runtime()
        self.max_body = settings.TOLLGATE_MAX_BODY_BYTES
        self.bounds = shield.Bounds.from_settings()
        self.allowed_hosts = list(settings.ALLOWED_HOSTS)
        if settings.DEBUG and not self.allowed_hosts:
            self.allowed_hosts = [".localhost", "127.0.0.1", "[::1]"]  # as Django does
        self._hosts: dict[bytes, bool] = {}

    @staticmethod
    def handles(path: str) -> bool:
        """Its own paths, and the engine's (answered 404: never the console's to answer)."""
        if path.startswith("/v1/"):
            return not path.startswith(DJANGO_V1)
        return path == "/metrics" or path == "/v1" or shield.engine_path(path)

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
        endpoint = ENDPOINTS.get(path)
        if endpoint in ANTHROPIC:
            send = AnthropicSend(send)
        if not self.host_allowed(scope):
            return await respond(send, 400, error_body("Invalid Host header."))
        if path == "/metrics":
            return await self.serve_metrics(scope, send)
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method != "GET":
                return await respond(
                    send, 405, error_body(f"Method {method} is not allowed on {path}.")
                )
            return await self.list_models(scope, send, path)
        if endpoint is None:
            if path.startswith(responses.PREFIX):
                return await self.kept_response(scope, send, path, method)
            return await respond(send, 404, invalid_url(method, path))
        if method != "POST":
            return await respond(
                send, 405, error_body(f"Method {method} is not allowed on {path}.")
            )
        try:
            await self.generate(scope, receive, send, endpoint)
        except ConnectionAbortedError:
            return

    # --- Authentication --------------------------------------------------------------------

    def authenticate(self, scope: dict) -> tuple[KeyInfo, TenantInfo] | None:
        """The key and tenant for the request's credentials (core.credentials' rule: the
        snapshot holds only keys that were usable when it loaded); the same work for every
        failure."""
        authorization = api_key = x_api_key = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"api-key":
                api_key = value.decode("latin-1")
            elif name == b"x-api-key":
                x_api_key = value.decode("latin-1")
        presented = presented_key(authorization, api_key, x_api_key)
        snap = self.rt.snapshot
        prefix = parse_key(presented)
        key = snap.keys.get(prefix) if prefix else None
        valid = verify_key(presented, key.secret_hash if key else None)
        if not valid or not unexpired(key.expires_at, time.time()):
            return None
        tenant = snap.tenants.get(key.tenant_id)
        return None if tenant is None else (key, tenant)

    def allowed(self, key: KeyInfo, tenant: TenantInfo, model: ModelInfo | None) -> bool:
        """Whether the key may call ``model`` (an adapter: one its tenant may call, on a base
        its key may call); the caller answers anything else exactly as a missing model."""
        if model is None or model.id not in tenant.model_ids:
            return False
        if model.adapter_id and model.adapter_id not in tenant.adapter_ids:
            return False
        return not key.model_ids or model.id in key.model_ids

    # --- /v1/models --------------------------------------------------------------------------

    async def list_models(self, scope: dict, send: Any, path: str) -> None:
        auth = self.authenticate(scope)
        if auth is None:
            return await respond(send, 401, INVALID_KEY)
        key, tenant = auth
        models = [
            m
            for m in sorted(self.rt.snapshot.models.values(), key=lambda m: m.served_name)
            if self.allowed(key, tenant, m)
        ]
        one = path != "/v1/models"
        wanted = path.removeprefix("/v1/models/")
        if one:
            models = [m for m in models if m.served_name == wanted]
            if not models:
                return await respond(send, 404, model_not_found(wanted))
        states = await self.rt.demand.states(models)  # on-demand models' (a Redis read)
        cards = [model_card(m, states.get(m.id)) for m in models]
        if one:
            return await respond(send, 200, orjson.dumps(cards[0]))
        await respond(send, 200, orjson.dumps({"object": "list", "data": cards}))

    # --- Kept responses ---------------------------------------------------------------------

    async def kept_response(self, scope: dict, send: Any, path: str, method: str) -> None:
        action, response_id = responses.route(path, method)
        if action is None:
            if response_id == 405:
                return await respond(
                    send, 405, error_body(f"Method {method} is not allowed on {path}.")
                )
            return await respond(send, 404, invalid_url(method, path))
        auth = self.authenticate(scope)
        if auth is None:
            return await respond(send, 401, INVALID_KEY)
        _, tenant = auth
        try:
            await responses.serve_object(
                self.rt.responses, send, action, response_id, tenant.id, scope["query_string"]
            )
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            await respond(send, 503, STORE_DOWN, [(b"retry-after", b"5")])

    # --- /metrics ------------------------------------------------------------------------------

    async def serve_metrics(self, scope: dict, send: Any) -> None:
        token = settings.TOLLGATE_METRICS_TOKEN
        presented = next(
            (v.decode("latin-1") for n, v in scope["headers"] if n == b"authorization"), ""
        )
        if not token or not hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
            return await respond(send, 404, error_body("Not found."))
        body, content_type = metrics.render()
        try:
            async with asyncio.timeout(2.0):
                stats = await self.rt.redis.hgetall(demand_stats_key())
                ledger = await self.rt.redis.hgetall(engine_ledger_stats_key())
            body += metrics.demand_stats(stats) + metrics.engine_ledger_stats(ledger)
        except (redis.exceptions.RedisError, OSError, TimeoutError):
            pass  # the process's own metrics still answer
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", content_type.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    # --- Generation ----------------------------------------------------------------------------

    async def generate(self, scope: dict, receive: Any, send: Any, endpoint: str) -> None:
        started = time.perf_counter()
        body = await read_body(receive, self.max_body)
        if body is None:
            return await respond(
                send, 413, error_body(f"The request body is larger than {self.max_body} bytes.")
            )
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
            metrics.REJECTIONS.labels(tenant.slug, "invalid_request").inc()
            return await respond(send, *problem)
        problem, dropped = shield.check(payload, endpoint, model, self.bounds)
        if problem:
            metrics.REJECTIONS.labels(tenant.slug, "engine_shield").inc()
            return await respond(send, *problem)
        if dropped:
            body = orjson.dumps(payload)
        plan = None
        if endpoint == "responses":
            try:
                prepared = await responses.prepare(self.rt.responses, payload, tenant.id, key.id)
            except (redis.exceptions.RedisError, OSError, TimeoutError):
                return await respond(send, 503, STORE_DOWN, [(b"retry-after", b"5")])
            if isinstance(prepared[0], int):
                return await respond(send, *prepared)
            payload, plan = prepared
            body = orjson.dumps(payload)
        if model.adapter_id:
            problem = adapter_problem(model)
            if problem and model.status == "checking":
                # Its check may have ended since this process last heard (the admin API
                # already says ready): look again before saying it is still being checked.
                model = await self.rt.look_again(model.served_name) or model
                problem = adapter_problem(model)
            if problem:
                return await respond(send, *problem)
        snap = self.rt.snapshot
        upstreams, start_wait_ms = snap.routes.get(model.id), None
        demand = snap.demand.get(model.id) if not upstreams else None
        if demand is not None:
            # Cold on-demand model (an adapter's: its base): have it started, and wait
            # before admission, so the wait holds none of the tenant's concurrency.
            waiting = time.perf_counter()
            upstreams = await self.wait_for_start(model, demand, receive)
            if isinstance(upstreams, tuple):
                metrics.REJECTIONS.labels(tenant.slug, "model_not_started").inc()
                return await respond(send, *upstreams)
            start_wait_ms = max(int((time.perf_counter() - waiting) * 1000), 1)
        if upstreams and model.adapter_id:
            upstreams = await self.rt.lora.ensure(model, upstreams)
            if isinstance(upstreams, tuple):
                metrics.REJECTIONS.labels(tenant.slug, "adapter_not_loaded").inc()
                return await respond(send, *upstreams)
        if not upstreams:
            metrics.REJECTIONS.labels(tenant.slug, "no_replica").inc()
            return await respond(
                send,
                503,
                error_body(
                    f"The model `{model.served_name}` has no engine ready to serve it. Please "
                    "retry shortly.",
                    "server_error",
                    code="model_not_ready",
                ),
                [(b"retry-after", b"10")],
            )
        exchange = Exchange(
            self.rt,
            send,
            endpoint,
            payload,
            body,
            key,
            tenant,
            model,
            upstreams,
            started,
            plan,
            start_wait_ms,
        )
        await admit_and_forward(exchange, scope, receive)

    async def wait_for_start(
        self, model: ModelInfo, demand: DemandInfo, receive: Any
    ) -> list[Upstream] | tuple:
        """gateway/demand.py's wait for a start, given up when the client hangs up (the
        start goes on: the next request finds it under way)."""
        waiting = asyncio.ensure_future(self.rt.demand.ensure(model, demand))
        gone = asyncio.ensure_future(_hung_up(receive))
        try:
            await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiting, gone):
                task.cancel()
        if waiting.done() and not waiting.cancelled():
            return waiting.result()
        raise ConnectionAbortedError

    def parse(self, body: bytes, endpoint: str) -> tuple[dict, tuple | None]:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {}, (
                400,
                error_body(
                    "We could not parse the JSON body of your request. Send valid JSON with "
                    "Content-Type: application/json."
                ),
            )
        if not isinstance(payload, dict):
            return {}, (400, error_body("The request body must be a JSON object."))
        if shield.too_deep(body, payload):
            return {}, (
                400,
                error_body(
                    f"The JSON body nests more than {shield.JSON_MAX_DEPTH} levels deep: the "
                    "limit on this appliance."
                ),
            )
        if not isinstance(payload.get("model"), str) or not payload["model"]:
            return {}, (400, error_body("You must provide a model parameter.", param="model"))
        return payload, None

    def check_request(self, payload: dict, model: ModelInfo, endpoint: str) -> tuple | None:
        """The request's model and stream options; its fields are the engine shield's
        (gateway/shield.py, next)."""
        if ENDPOINT_TASKS[endpoint] != model.task:
            kind = TASK_KINDS.get(model.task, f"a {model.task}")
            path = next(p for p, e in ENDPOINTS.items() if e == endpoint)
            return 400, error_body(
                f"`{model.served_name}` is {kind} model and is not supported on {path}.",
                param="model",
                code="model_not_supported",
            )
        if payload.get("stream_options") is not None and payload.get("stream") is not True:
            return 400, error_body(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        return None


async def _hung_up(receive: Any) -> None:
    """Returns when the client disconnects (its body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def model_card(model: ModelInfo, demand_state: str | None = None) -> dict:
    """A model's /v1/models card; an adapter's names its base (as vLLM's cards do). An
    on-demand model's (an adapter's: its base's) says whether its engine runs now."""
    card = {"id": model.served_name, "object": "model", "created": model.created}
    card["owned_by"] = "tollgate"
    if model.adapter_id:
        card["parent"] = model.parent
    if demand_state:
        card["tollgate"] = {"mode": "on_demand", "state": demand_state}
    return card


def adapter_problem(model: ModelInfo) -> tuple | None:
    """Why an adapter the tenant may call cannot be called yet (its files are checked first)."""
    if model.status == "ready":
        return None
    if model.status == "failed":
        return 400, error_body(
            f"The adapter `{model.served_name}` failed its check: {model.status_message}",
            param="model",
            code="model_not_supported",
        )
    return (
        503,
        error_body(
            f"The adapter `{model.served_name}` is still being checked. Please retry shortly.",
            "server_error",
            code="model_not_ready",
        ),
        [(b"retry-after", b"10")],
    )
