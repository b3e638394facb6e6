"""Billing that cannot be dodged: what of a request is billed, and its prompt counted when the
engine never said.

A request an engine took pays its prompt exactly once, however it ended: finished, or cut
by the client (even before the first token); a request the engine failed pays only if it
delivered something. Completion tokens are those handed to the client (gateway/relay.py
counts them from the engine's running usage, else one per content chunk: a role-only or
empty chunk is none).

The prompt's tokens come from, in this order:
1. the engine's usage (running usage on the first chunk, the final usage, the whole answer);
2. the engine's own tokenizer, asked after the response ended (off the client's path):
   ``/tokenize`` with the chat ``messages`` (or the completion ``prompt``) exactly as sent,
   with the chat messages the engine makes of a Responses request (its whole conversation:
   gateway/responses.py expands ``previous_response_id`` before forwarding), and
   ``/v1/messages/count_tokens`` for Anthropic Messages (vLLM's own conversion of the
   request, so the count is the one the engine would have reported);
3. only where neither exists (the engine went away): an estimate from the request's text,
   recorded with ``prompt_estimated`` so the ledger and the showback CSV say so.

A gateway process killed mid-request cannot count anything: so what counting needs is put
on the request's open record at admission (``orphan_prompt``: the estimate, and for prompts
up to ``RECORDED_PROMPT_BYTES`` the counting calls themselves), and the orphan reaper
(gateway/orphans.py) counts with it (``count_prompt_sync``) in the same order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.responses import chat_messages, chat_tools
from gateway.state import Upstream
from gateway.usage import Outcome

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("tollgate.gateway")

TOKENIZE_TIMEOUT = 5.0  # seconds for all of one request's counting calls
BYTES_PER_TOKEN = 4  # the estimate: text bytes per token (overestimates for English)
# Prompts up to this size (the engine body) keep their counting calls on the open record, so
# a reaper can ask the engine's tokenizer; larger ones keep only the estimate (copying a long
# prompt into Redis on every request, for the rare crash, would cost more than it saves).
RECORDED_PROMPT_BYTES = 16 * 1024

# One counting call: (engine path, body, the answer's field holding the count).
Call = tuple[str, dict[str, Any], str]


def _chat_calls(payload: dict) -> tuple[list[Call], int]:
    body: dict[str, Any] = {"model": payload["model"], "messages": payload.get("messages")}
    for field in ("tools", "chat_template_kwargs", "add_generation_prompt"):
        if payload.get(field) is not None:
            body[field] = payload[field]
    return [("/tokenize", body, "count")], 0


def _completion_calls(payload: dict) -> tuple[list[Call], int]:
    """One /tokenize per text prompt; token-id prompts are counted as they are."""
    prompt = payload.get("prompt")
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if prompts and all(isinstance(p, int) for p in prompts):
        return [], len(prompts)  # one prompt given as token ids
    calls, known = [], 0
    for item in prompts:
        if isinstance(item, str):
            calls.append(("/tokenize", {"model": payload["model"], "prompt": item}, "count"))
        elif isinstance(item, list):
            known += len(item)
    return calls, known


def _messages_calls(payload: dict) -> tuple[list[Call], int]:
    body = {
        k: payload[k]
        for k in ("model", "messages", "system", "tools", "tool_choice", "thinking")
        if payload.get(k) is not None
    }
    return [("/v1/messages/count_tokens", body, "input_tokens")], 0


def _responses_calls(payload: dict) -> tuple[list[Call], int]:
    """The engine's chat messages of the request (its input, a previous_response_id already
    expanded by the gateway, and instructions) and its tools, as the engine builds them."""
    body: dict[str, Any] = {"model": payload["model"], "messages": chat_messages(payload)}
    tools = chat_tools(payload)
    if tools:
        body["tools"] = tools
    return [("/tokenize", body, "count")], 0


# Endpoints whose prompt Tollgate counts when the engine did not report it.
PROMPT_COUNTS: dict[str, Callable[[dict], tuple[list[Call], int]]] = {
    "chat": _chat_calls,
    "completions": _completion_calls,
    "messages": _messages_calls,
    "responses": _responses_calls,
}
PROMPT_FIELDS = ("messages", "prompt", "system", "tools", "input", "instructions")


def billable(endpoint: str, outcome: Outcome) -> bool:
    """Whether the request is billed at all (what for: its outcome's tokens)."""
    if outcome.status == "ok" or outcome.completion_tokens > 0:
        return True
    # Cut by the client after the engine took it: the engine did the prefill.
    return (
        outcome.status == "client_closed"
        and endpoint in PROMPT_COUNTS
        and outcome.forwarded
        and outcome.http_status in (0, 200)
    )


def estimate_prompt(payload: dict) -> int:
    """The last resort: the prompt's text at ``BYTES_PER_TOKEN`` bytes a token."""
    text = orjson.dumps({k: payload[k] for k in PROMPT_FIELDS if k in payload})
    return max(len(text) // BYTES_PER_TOKEN, 1)


def orphan_prompt(endpoint: str, payload: dict, body: bytes) -> dict[str, Any] | None:
    """What the open record keeps for counting the prompt should the gateway die (None: the
    endpoint's prompt is not billed on its own): the counting calls, or for a long prompt its
    estimate (made here only then: the common case pays for no estimate)."""
    counts = PROMPT_COUNTS.get(endpoint)
    if counts is None:
        return None
    if len(body) > RECORDED_PROMPT_BYTES:
        return {"estimate": estimate_prompt(payload)}
    calls, known = counts(payload)  # the estimate, should it be needed, is made from these
    return {"calls": calls, "known": known}


def count_prompt_sync(kept: dict[str, Any], upstreams: list[Upstream]) -> tuple[int, bool]:
    """(prompt tokens, estimated?) of an orphaned request from its ``orphan_prompt``: the
    engines' tokenizer where the record kept the calls and an engine answers, else the
    estimate."""
    import httpx  # the reaper's (Celery) client: the gateway process never loads it

    calls = kept.get("calls")
    if calls is not None:
        with httpx.Client(timeout=TOKENIZE_TIMEOUT) as client:
            for upstream in upstreams:
                counted = _ask_sync(client, upstream, calls)
                if counted is not None:
                    return int(kept.get("known") or 0) + counted, False
    if "estimate" in kept:
        return int(kept["estimate"]), True
    # No engine answers: the estimate, from the very texts the engine would have counted.
    estimated = sum(estimate_prompt(body) for _, body, _ in calls or ())
    return int(kept.get("known") or 0) + estimated, True


def _ask_sync(client: httpx.Client, upstream: Upstream, calls: list) -> int | None:
    headers = {"content-type": "application/json"}
    if upstream.auth_header:
        headers["authorization"] = upstream.auth_header
    total = 0
    try:
        for path, body, field in calls:
            resp = client.post(
                upstream.base_url + path, content=orjson.dumps(body), headers=headers
            )
            if resp.status_code != 200:
                return None
            total += int(resp.json()[field])
    except Exception:  # noqa: BLE001 - any failure: try elsewhere, or estimate
        return None
    return total


async def count_prompt(
    session: Any,
    endpoint: str,
    payload: dict,
    outcome: Outcome,
    chosen: Upstream | None,
    upstreams: list[Upstream],
) -> None:
    """Set the outcome's prompt tokens by the engine's tokenizer (the replica that served the
    request first, then the others), else by the estimate, marked as such."""
    calls, known = PROMPT_COUNTS[endpoint](payload)
    order = ([chosen] if chosen else []) + [u for u in upstreams if u is not chosen]
    for upstream in order:
        counted = await _ask(session, upstream, calls)
        if counted is not None:
            outcome.prompt_tokens = known + counted
            outcome.prompt_known = True
            return
    outcome.prompt_tokens = estimate_prompt(payload)
    outcome.prompt_estimated = True
    log.warning("no engine could count a prompt: billed an estimate of %d", outcome.prompt_tokens)


async def _ask(session: Any, upstream: Upstream, calls: list[Call]) -> int | None:
    headers = {"content-type": "application/json"}
    if upstream.auth_header:
        headers["authorization"] = upstream.auth_header
    total = 0
    try:
        async with asyncio.timeout(TOKENIZE_TIMEOUT):
            for path, body, field in calls:
                resp = await session.post(
                    upstream.base_url + path, data=orjson.dumps(body), headers=headers
                )
                try:
                    raw = await resp.read()
                finally:
                    resp.close()
                if resp.status != 200:
                    return None
                total += int(orjson.loads(raw)[field])
    except (Exception, TimeoutError):  # noqa: BLE001 - any failure: try elsewhere, or estimate
        return None
    return total
