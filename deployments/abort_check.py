"""Does an engine stop a request whose client left? Asked of the engine itself, while idle.

The gateway preempts a running P2 request by closing its connection (gateway/preempt.py):
that frees an engine slot only where the engine aborts a request whose client went away, as
vLLM does. An engine (or a proxy in front of one) that finishes it instead keeps the slot
busy for a whole reply, and every preemption there costs P0 more than it saves. The
controller also judges preemptions from the engine's counts under load
(gateway/controller.py), but only after the first one has happened; this check answers
before any, on an idle engine, where it costs a few tokens and disturbs nobody: one
streamed request, the connection closed at its first token, then the engine's own running
count watched.
"""

from __future__ import annotations

import logging
import time

import httpx

from core.keyspace import engine_own_key
from core.redis import get_redis
from deployments.engine import PROBE_TIMEOUT, _headers, _trust, in_flight, scrape

log = logging.getLogger("tollgate.deployments")

# Long enough that no engine finishes it in the moment the check watches, short enough that
# where the engine does not abort, the request it runs on ends soon (seconds on a GPU).
CHECK_TOKENS = 256
# vLLM drops a request whose client left at its next token, within milliseconds; the check
# allows an idle but slow box far more.
SETTLE_SECONDS = 1.0
REQUEST_ID = "tollgate-abort-check"


def engine_drops_abandoned(
    base_url: str, served_name: str, key: str = "", replica_id: int | None = None
) -> bool | None:
    """True: the engine dropped the request once its client left; False: it went on with
    it; None: no answer (the engine was not idle, other work arrived meanwhile, the request
    finished before the check could tell, or the engine did not answer as expected).

    The check's tokens are nobody's bill: with ``replica_id``, they are recorded as
    Tollgate's own (core.keyspace.engine_own_key), for the bill's check against the engine."""
    before = scrape(base_url, key)
    if in_flight(before) != 0:
        return None
    sent = _first_token_then_leave(base_url, served_name, key)
    verdict, after = _watch(base_url, key, before) if sent else (None, None)
    if replica_id is not None:  # a request went out: its tokens, if any, are Tollgate's own
        note_own_tokens(replica_id, before, after, verdict)
    return verdict


def _watch(
    base_url: str, key: str, before: dict[str, float]
) -> tuple[bool | None, dict[str, float] | None]:
    """Watch the engine's count after the hang-up: (verdict, the figures it was read from)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        figures = scrape(base_url, key)
        count = in_flight(figures)
        if count is None or count > 1:
            return None, None  # gone, or someone else's work: nothing to read from the count
        if count == 0:
            made = figures.get("generation_tokens_total", 0) - before.get(
                "generation_tokens_total", 0
            )
            # Finished, not dropped, when it made every token it was asked for.
            return (True if made < CHECK_TOKENS else None), figures
        if time.monotonic() >= deadline:
            return False, figures
        time.sleep(0.05)


def note_own_tokens(
    replica_id: int,
    before: dict[str, float],
    after: dict[str, float] | None,
    verdict: bool | None,
) -> None:
    """Record the check request's tokens as Tollgate's own. Read off the engine's counters
    around it, they are exact when the engine was busy with nothing else: idle again (``after``
    read then), or going on with it alone (it then makes exactly CHECK_TOKENS,
    ``ignore_eos``). Otherwise (no ``after``) they cannot be told from others' and the
    stretch is marked inexact."""
    own = engine_own_key(replica_id)
    if after is None:
        get_redis().hincrby(own, "inexact", 1)
        return

    def grew(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    generation = CHECK_TOKENS if verdict is False else grew("generation_tokens_total")
    with get_redis().pipeline() as pipe:
        pipe.hincrby(own, "prompt", grew("prompt_tokens_total"))
        pipe.hincrby(own, "cached", grew("prompt_tokens_cached_total"))
        pipe.hincrby(own, "generation", generation)
        pipe.execute()


def _first_token_then_leave(base_url: str, served_name: str, key: str) -> bool:
    """Send the check request, read up to its first streamed token, hang up. False when the
    engine did not stream (an error, or no generation model under that name)."""
    body = {
        "model": served_name,
        "prompt": "Tollgate checks whether this engine stops a request its client left.",
        "max_tokens": CHECK_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {**_headers(key), "X-Request-Id": REQUEST_ID}
    timeout = httpx.Timeout(PROBE_TIMEOUT, read=30.0)
    try:
        with (
            httpx.Client(timeout=timeout, verify=_trust()) as client,
            client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r,
        ):
            if r.status_code != 200:
                return False
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    return True  # leaving the block closes the connection
    except httpx.HTTPError:
        log.info("abort check on %s: no answer", base_url, exc_info=True)
    return False
