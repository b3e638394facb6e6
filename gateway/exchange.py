"""One request's exchange with an engine: admit, wait for a slot, forward, relay, settle.

gateway/app.py routes, authenticates and validates a request; here it is admitted (one Lua
call: rate limits, concurrency, quota and an engine slot), waits in the priority queue when
the model's engines are busy, goes to the least busy replica (the relay passes the answer
through, gateway/relay.py), and is settled (one Lua call: real usage, release, the usage
record). What a request carries through these steps is one ``Exchange``; each step is a
module of its own: gateway/serving.py runs them in order, gateway/admit.py admits (and
queues), gateway/forwarding.py forwards (gateway/preemptible.py a request the gateway may
preempt), gateway/settling.py settles.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.admission import Claim
from gateway.responses import ResponsePlan
from gateway.runtime import Runtime
from gateway.state import KeyInfo, ModelInfo, PriceInfo, TenantInfo, Upstream

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
    queueing, forwarding and settling it need (slots: no per-request ``__dict__``)."""

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
        "plan",
        "start_wait_ms",
        "occurred",
        "request_id",
        "price",
        "claim",
        "headers",
        "disconnect",
    )
    # Set by admission:
    occurred: float  # time() when it was admitted: the usage record's time
    request_id: str
    price: PriceInfo | None  # the price in force then
    claim: Claim  # its claim on an engine slot of its model (gateway/admission.py)
    headers: list[tuple[bytes, bytes]]  # Tollgate's headers, on every answer
    disconnect: Disconnect  # the client's connection

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
        plan: ResponsePlan | None = None,
        start_wait_ms: int | None = None,
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
        self.start_wait_ms = start_wait_ms  # how long it waited for an on-demand start
