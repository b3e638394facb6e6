"""Forwarding a request the gateway may preempt (gateway/preempt.py says which and how).

Admission may give its engine slot to a higher class at any moment: the process serving it
hears so on a channel (gateway/runtime.py calls ``on_preempt``), aborts it upstream,
queues it again at the head of its class and, once readmitted, resumes it from what its
client already received.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gateway import billing, metrics, preempt
from gateway.admit import upstream_body
from gateway.errors import error_body
from gateway.exchange import Exchange
from gateway.forwarding import Forwarding
from gateway.relay import Preempted, forward_stream, forward_whole, respond, resume_stream
from gateway.state import Upstream
from gateway.upstream import UpstreamRefused
from gateway.usage import USAGE_SHAPES


class PreemptibleForwarding(Forwarding):
    """Forwarding that stops when the request is preempted and goes on once readmitted."""

    __slots__ = ("preempted", "preemptions", "relay_task")

    def __init__(self, ex: Exchange) -> None:
        super().__init__(ex)
        self.preempted = False  # its slot went to a higher class: stop relaying
        self.preemptions = 0
        self.relay_task: asyncio.Task | None = None  # set while it is relayed

    def on_preempt(self) -> None:
        """Admission gave this request's slot to a higher class: abort it upstream (closing
        the connection frees the engine's slot), unless a send to the client is under way
        (the relay stops after it) or the answer is already complete."""
        self.preempted = True
        task, st = self.relay_task, self.st
        if task is None:
            return  # not relaying: _send sees the flag before it forwards
        if st is not None:
            if st.sending:
                st.preempt = True
                return
        elif self.outcome.started:
            return  # the whole answer is in hand: it goes to the client
        task.cancel()

    async def _send(self, upstream: Upstream, url: str, headers: dict[str, str]) -> None:
        """Relay the request; when it is preempted, queue it again at the head of its class
        and resume it once readmitted."""
        ex, rt, st, outcome = self.ex, self.ex.rt, self.st, self.outcome
        task = asyncio.current_task()
        if st is not None:
            st.sent = []
        body, resumed = ex.body, False
        while True:
            if not self.preempted:
                self.relay_task = task
                try:
                    if resumed:
                        await resume_stream(
                            rt.session, url, body, headers, ex.send, st, rt.max_frame
                        )
                    elif self.stream:
                        await forward_stream(
                            rt.session,
                            url,
                            body,
                            headers,
                            ex.send,
                            ex.headers,
                            st,
                            rt.max_frame,
                            bool(ex.model.adapter_id),
                        )
                    else:
                        shape = USAGE_SHAPES[ex.endpoint]
                        await forward_whole(
                            rt.session,
                            url,
                            body,
                            headers,
                            ex.send,
                            ex.headers,
                            outcome,
                            shape,
                            adapter=bool(ex.model.adapter_id),
                        )
                    return
                except asyncio.CancelledError:
                    if not self.preempted or ex.disconnect.event.is_set():
                        raise
                    task.uncancel()
                except Preempted:
                    pass
                except UpstreamRefused as exc:
                    if not resumed:
                        raise  # nothing was sent yet: forwarding tries the next replica
                    raise RuntimeError("the engine refused the resumed request") from exc
                finally:
                    self.relay_task = None
            self.preempted = False
            self.preemptions += 1
            self.outcome.preemptions = self.preemptions
            metrics.PREEMPTIONS.labels(ex.model.served_name, ex.claim.priority).inc()
            if self.stream and outcome.started:
                body, resumed = await self._resumption(upstream), True
            if not await self._readmit():
                return

    async def _resumption(self, upstream: Upstream) -> bytes:
        """The engine body that continues a preempted stream after what its client received;
        the stream's frames from then on continue the client's stream."""
        ex, st, outcome = self.ex, self.st, self.outcome
        st.preempt = False
        text, ident, created = preempt.delivered(st, ex.endpoint)
        emitted = outcome.completion_tokens
        if text and not outcome.prompt_known:  # the engine sends usage only at the end
            await billing.count_prompt(
                ex.rt.session, ex.endpoint, ex.payload, outcome, upstream, ex.upstreams
            )
        prompt = outcome.prompt_tokens if outcome.prompt_tokens else None
        again = preempt.resumed_payload(ex.payload, ex.endpoint, text, emitted)
        st.transform = preempt.resumed_transform(st, ex.endpoint, ident, created, prompt, emitted)
        return upstream_body(again, b"", True, True)

    async def _readmit(self) -> bool:
        """Queue a preempted request at the head of its class until a slot frees; False
        (and the client told, unless it left) when it may not wait any longer."""
        ex, outcome = self.ex, self.outcome
        disconnect, task = ex.disconnect, ex.disconnect.cancel_on
        disconnect.cancel_on = None  # a client leaving now ends the wait (which cleans up)
        try:
            # Preempted at most TOLLGATE_ADMISSION_PREEMPT_MAX_TIMES times; then it runs on.
            victim = preempt.may_be_victim(self.preemptions)
            claim = replace(ex.claim, victim=victim, head=True)
            ticket = await ex.rt.admission.wait(claim, disconnect.event)
        finally:
            disconnect.cancel_on = task
        if ticket.admitted:
            return True
        if disconnect.event.is_set():
            outcome.status = "client_closed"
            if not self.stream:
                outcome.completion_tokens = 0
            return False
        message = (
            f"The model `{ex.model.served_name}` is busy: this {ex.claim.priority} request was "
            f"paused for a higher class and waited {ticket.waited:.0f}s to resume."
        )
        outcome.status = "error"
        if self.stream and outcome.started:
            failed = self.st.failure(message)
            await ex.send({"type": "http.response.body", "body": failed, "more_body": False})
        else:
            outcome.http_status = 429
            await respond(
                ex.send,
                429,
                error_body(message, "requests", code="rate_limit_exceeded"),
                ex.headers + [(b"retry-after", str(ticket.retry_after).encode())],
            )
        return False
