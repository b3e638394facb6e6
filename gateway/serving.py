"""Serving one accepted request (gateway/app.py accepted it): admit it or answer why not,
forward it now or after waiting for an engine slot, settle it, and clean up after it. The
steps are gateway/admit.py, gateway/forwarding.py (gateway/preemptible.py) and
gateway/settling.py; what they share is the request's ``Exchange`` (gateway/exchange.py).
"""

from __future__ import annotations

import time
from typing import Any

from gateway.admit import admit, ratelimit_headers, wait_for_slot
from gateway.exchange import Disconnect, Exchange
from gateway.forwarding import Forwarding
from gateway.limiter import Decision
from gateway.preemptible import PreemptibleForwarding
from gateway.settling import settle


async def admit_and_forward(ex: Exchange, scope: dict, receive: Any) -> None:
    """Admit the request (or answer why not), then serve it and clean up after it."""
    decision = await admit(ex, scope)
    if decision is None:
        return
    rt, request_id = ex.rt, ex.request_id
    rt.used_keys.add(ex.key.id)
    rt.open_requests.add(request_id)
    ex.headers = ratelimit_headers(decision) + [
        (b"x-request-id", request_id.encode()),
        (b"x-tollgate-priority", ex.claim.priority.encode()),
    ]
    ex.disconnect = Disconnect(receive)
    if ex.claim.victim:
        forwarding = rt.preemptible[request_id] = PreemptibleForwarding(ex)
    else:
        forwarding = Forwarding(ex)
    try:
        await serve(ex, decision, forwarding)
    finally:
        if ex.claim.victim:
            rt.preemptible.pop(request_id, None)
        ex.disconnect.close()
        # Settled, or else left on record for the reaper (its lease lapses once we stop
        # renewing it).
        rt.open_requests.discard(request_id)
        rt.admission.running.pop(request_id, None)


async def serve(ex: Exchange, decision: Decision, forwarding: Forwarding) -> None:
    """Forward now (admission gave it a slot) or after queueing for one; then settle."""
    admission, request_id, model_id = ex.rt.admission, ex.request_id, ex.model.id
    upstream = None
    if decision.slot:
        admission.holding(request_id, model_id)
        outcome, upstream = await forwarding.run()
    elif (outcome := await wait_for_slot(ex)) is None:
        outcome, upstream = await forwarding.run()
    admission.finished(
        request_id, model_id, time.perf_counter() - ex.started, outcome.completion_tokens
    )
    await settle(ex, decision.reservation, outcome, upstream)
