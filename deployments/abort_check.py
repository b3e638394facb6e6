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

from deployments.engine import PROBE_TIMEOUT, _headers, _trust, in_flight, scrape

log = logging.getLogger("tollgate.deployments")

# Long enough that no engine finishes it in the moment the check watches, short enough that
# where the engine does not abort, the request it runs on ends soon (seconds on a GPU).
CHECK_TOKENS = 256
# vLLM drops a request whose client left at its next token, within milliseconds; the check
# allows an idle but slow box far more.
SETTLE_SECONDS = 1.0
REQUEST_ID = "tollgate-abort-check"


def engine_drops_abandoned(base_url: str, served_name: str, key: str = "") -> bool | None:
    """True: the engine dropped the request once its client left; False: it went on with
    it; None: no answer (the engine was not idle, other work arrived meanwhile, the request
    finished before the check could tell, or the engine did not answer as expected)."""
    before = scrape(base_url, key)
    if in_flight(before) != 0:
        return None
    if not _first_token_then_leave(base_url, served_name, key):
        return None
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        figures = scrape(base_url, key)
        count = in_flight(figures)
        if count is None or count > 1:
            return None  # gone, or someone else's work: nothing to read from the count
        if count == 0:
            made = figures.get("generation_tokens_total", 0) - before.get(
                "generation_tokens_total", 0
            )
            # Finished, not dropped, when it made every token it was asked for.
            return True if made < CHECK_TOKENS else None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


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
