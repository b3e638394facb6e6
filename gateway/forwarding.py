"""Forwarding one admitted request (gateway/exchange.py) to the replica routing picks
(gateway/routing.py; the next one if it refuses the connection), its answer passed to the
client in its API's dialect: OpenAI's through gateway/relay.py, Anthropic's Messages
events (gateway/messages.py), the Responses API's (gateway/responses.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

from gateway import messages, metrics
from gateway.errors import error_body
from gateway.exchange import PROMPT_ONLY, UPSTREAM_PATHS, Exchange
from gateway.relay import AdapterGone, StreamState, forward_stream, forward_whole, respond
from gateway.responses import ResponseRelay
from gateway.settling import checkpoint
from gateway.state import Upstream
from gateway.upstream import UpstreamRefused
from gateway.usage import USAGE_SHAPES, Outcome

NO_ENGINE = error_body(
    "No engine for this model accepted the connection. Please retry shortly.",
    "server_error",
    code="model_not_ready",
)
ENGINE_FAILED = error_body("The engine failed while answering. Please retry.", "server_error")

log = logging.getLogger("tollgate.gateway")


class Forwarding:
    """One request's way to an engine and back: the outcome its relay fills (and its stream's
    state), and the replica that served it."""

    __slots__ = ("ex", "stream", "outcome", "st", "answer", "chosen")

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self.stream = False
        self.outcome: Outcome | None = None
        self.st: StreamState | None = None
        # A Responses answer's reader (ResponseRelay.answer): reads, keeps and echoes it.
        self.answer: Callable[[Outcome, bytes], Awaitable[bytes]] | None = None
        self.chosen: Upstream | None = None

    async def run(self) -> tuple[Outcome, Upstream | None]:
        """Send the request to a replica and pass its answer to the client; returns what
        happened and the replica that took it."""
        self._prepare()
        outcome, disconnect = self.outcome, self.ex.disconnect
        task = asyncio.current_task()
        disconnect.cancel_on = task
        if disconnect.event.is_set():
            outcome.status = "client_closed"
            return outcome, None
        try:
            await self._to_a_replica()
        except asyncio.CancelledError:
            if not disconnect.event.is_set():
                raise
            task.uncancel()
            outcome.status = "client_closed"
            if not self.stream:
                outcome.completion_tokens = 0  # the answer never reached the client
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-request
            await self._failed(exc)
        finally:
            disconnect.cancel_on = None
        return outcome, self.chosen

    def _prepare(self) -> None:
        """The outcome, and for a stream its state, in the endpoint's dialect."""
        ex = self.ex
        payload, endpoint = ex.payload, ex.endpoint
        self.stream = stream = payload.get("stream") is True and endpoint not in PROMPT_ONLY
        self.outcome = outcome = Outcome()
        st = None
        if stream:
            options = payload.get("stream_options") or {}
            wants_usage = bool(options.get("include_usage"))
            st = self.st = StreamState(
                wants_usage=wants_usage,
                wants_continuous=wants_usage and bool(options.get("continuous_usage_stats")),
                started_at=ex.started,
                outcome=outcome,
                checkpoint=partial(checkpoint, ex),
                # The first checkpoint after a second: not in the way of the first token.
                last_checkpoint=time.monotonic(),
            )
            if endpoint == "messages":
                st.transform, st.error_frames = messages.transform_event, messages.stream_error
        if ex.plan is not None:
            dialect = ResponseRelay(ex.plan, ex.rt.responses)
            if st is not None:
                dialect.attach(st)
            self.answer = dialect.answer

    async def _to_a_replica(self) -> None:
        """Try the replicas in routing's order until one takes the request; a request for an
        adapter the engines dropped meanwhile goes where it is held (loaded again), once."""
        ex = self.ex
        adapter = ex.model.adapter_id
        replicas = await self._ordered(ex.upstreams)
        for attempt in range(2 if adapter else 1):
            gone = await self._try(replicas)
            if gone is None:
                return
            if not gone or attempt:
                break
            found = await ex.rt.lora.ensure(ex.model, ex.rt.snapshot.routes.get(ex.model.id, []))
            if isinstance(found, tuple):
                self.outcome.http_status = found[0]
                await respond(ex.send, found[0], found[1], ex.headers + found[2])
                return
            replicas = await self._ordered(found)
        await respond(ex.send, 503, NO_ENGINE, ex.headers + [(b"retry-after", b"5")])
        self.outcome.http_status = 503

    async def _ordered(self, replicas: list[Upstream]) -> list[Upstream]:
        ex = self.ex
        if len(replicas) < 2:
            return replicas
        # An adapter's prefixes are cached apart from its base's (vLLM keys the KV cache by
        # adapter too): its own table.
        adapter = ex.model.adapter_id
        table = f"{ex.model.id}.{adapter}" if adapter else ex.model.id
        return await ex.rt.router.order(table, ex.endpoint, ex.payload, replicas)

    async def _try(self, replicas: list[Upstream]) -> bool | None:
        """Send to the first replica that takes the request: None once one did; else whether
        an engine no longer held the request's adapter."""
        ex = self.ex
        outcome, model_name, adapter = self.outcome, ex.payload["model"], ex.model.adapter_id
        path = UPSTREAM_PATHS[ex.endpoint]
        headers = {"content-type": "application/json", "x-request-id": ex.request_id}
        gone = False
        for upstream in replicas:
            self.chosen = upstream
            if adapter:
                ex.rt.lora.touch(upstream.replica_id, adapter)
            if upstream.on_demand:
                ex.rt.demand.begin(upstream.deployment_id)
            upstream.outstanding += 1
            metrics.in_flight[model_name] += 1
            try:
                outcome.forwarded = True
                sent = headers
                if upstream.auth_header:
                    sent = {**headers, "authorization": upstream.auth_header}
                await self._send(upstream, upstream.base_url + path, sent)
                return None
            except UpstreamRefused:
                outcome.forwarded = False
                metrics.UPSTREAM_ERRORS.labels(model_name, "refused").inc()
                # Nothing was sent yet: try the next replica.
            except AdapterGone:
                outcome.forwarded = False
                ex.rt.lora.forget(upstream.replica_id, adapter)
                gone = True
            finally:
                upstream.outstanding -= 1
                metrics.in_flight[model_name] -= 1
                if upstream.on_demand:
                    ex.rt.demand.end(upstream.deployment_id)
        return gone

    async def _send(self, upstream: Upstream, url: str, headers: dict[str, str]) -> None:
        """Send the request to one replica and relay its answer (UpstreamRefused: it did not
        take the request)."""
        ex, rt = self.ex, self.ex.rt
        adapter = bool(ex.model.adapter_id)
        if self.stream:
            await forward_stream(
                rt.session,
                url,
                ex.body,
                headers,
                ex.send,
                ex.headers,
                self.st,
                rt.max_frame,
                adapter,
            )
        else:
            await forward_whole(
                rt.session,
                url,
                ex.body,
                headers,
                ex.send,
                ex.headers,
                self.outcome,
                USAGE_SHAPES[ex.endpoint],
                self.answer,
                adapter,
            )

    async def _failed(self, exc: Exception) -> None:
        """The engine failed mid-request: the client gets an error answer, or its stream an
        error event."""
        ex, outcome = self.ex, self.outcome
        metrics.UPSTREAM_ERRORS.labels(ex.payload["model"], exc.__class__.__name__).inc()
        log.warning(
            "request %s: the engine%s failed mid-request: %r%s",
            ex.request_id,
            f" (replica {self.chosen.replica_id})" if self.chosen else "",
            exc,
            f" (from {exc.__cause__!r})" if exc.__cause__ else "",
        )
        outcome.status = "error"
        if not outcome.started:
            outcome.http_status = 502
            await respond(ex.send, 502, ENGINE_FAILED, ex.headers)
        elif self.st is not None:
            failed = self.st.failure("The engine failed while answering.")
            await ex.send({"type": "http.response.body", "body": failed})
