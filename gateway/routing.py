"""Which replica of a model serves a request.

Agents resend the same long prefix every turn (system prompt, tools, the conversation so
far), and prefill is the expensive part of a request on a Spark; an engine that served the
prefix before still holds its KV cache and skips that prefill. So with
``TOLLGATE_ROUTING=prefix`` (the default) a request goes to the replica that most recently
served the longest of its prefixes, as long as that keeps the load within
``TOLLGATE_ROUTING_LOAD_FACTOR`` × the mean (bounded loads); a new prefix goes to the
least-loaded replica. The table of prefixes lives in Redis (gateway/route.lua), so every
gateway process routes a conversation the same way; a model with one replica skips all
of it. ``least_loaded`` and ``round_robin`` are there to compare against.

A prefix is identified by a chained digest of the request's leading parts, one digest per
part boundary: chat — tools, then each message; messages (Anthropic) — system and tools,
then each message; responses — instructions and tools, then each input item; completions —
the prompt in fixed-size chunks (full chunks only, so the next, longer prompt shares them).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from pathlib import Path

import orjson
import redis.exceptions

from core.hot import setting
from core.keyspace import route_keys
from gateway.redispipe import RedisPipe, Script
from gateway.state import Upstream

log = logging.getLogger("tollgate.gateway")

_ROUTE = Script((Path(__file__).parent / "route.lua").read_text())
MAX_DIGESTS = 32  # the longest prefixes looked up: a conversation's last 32 boundaries
PROMPT_CHUNK_CHARS = 4096
PROMPT_CHUNK_TOKENS = 1024
TABLE_SIZE = 200_000  # prefixes remembered per model


def _dump(value: object) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _chunks(prompt: object) -> list[bytes]:
    """A completions prompt in full chunks (a string's characters or a list's token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        size = PROMPT_CHUNK_CHARS
        return [prompt[i : i + size].encode() for i in range(0, len(prompt) - size + 1, size)]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        size = PROMPT_CHUNK_TOKENS
        return [_dump(prompt[i : i + size]) for i in range(0, len(prompt) - size + 1, size)]
    return []


def _parts(endpoint: str, payload: dict) -> tuple[bytes, list]:
    """(what every prefix of the request starts with, the parts that follow in order)."""
    if endpoint == "chat":
        return _dump(payload.get("tools")), payload.get("messages") or []
    if endpoint == "messages":
        return _dump([payload.get("system"), payload.get("tools")]), payload.get("messages") or []
    if endpoint == "responses":
        items = payload.get("input")
        items = [items] if isinstance(items, str) else items if isinstance(items, list) else []
        return _dump([payload.get("instructions"), payload.get("tools")]), items
    if endpoint == "completions":
        return b"", _chunks(payload.get("prompt"))
    return b"", []


def prefix_digests(endpoint: str, payload: dict) -> list[str]:
    """The request's prefix digests, longest first (at most ``MAX_DIGESTS``)."""
    head, parts = _parts(endpoint, payload)
    if not parts:
        return []
    h = hashlib.blake2b(head, digest_size=12)
    digests = []
    for part in parts:
        h.update(b"\x1e")
        h.update(part if type(part) is bytes else _dump(part))
        digests.append(h.hexdigest())
    return digests[::-1][:MAX_DIGESTS]


def _load(u: Upstream) -> float:
    return u.outstanding / max(u.max_num_seqs, 1)


class Router:
    """Orders a model's replicas for one request: the first is tried first."""

    def __init__(self, pipe: RedisPipe) -> None:
        self.pipe = pipe
        self._turn = itertools.count()

    async def order(
        self, model_id: int | str, endpoint: str, payload: dict, upstreams: list[Upstream]
    ) -> list[Upstream]:
        if len(upstreams) < 2:
            return upstreams
        policy = setting("TOLLGATE_ROUTING")
        if policy == "round_robin":
            turn = next(self._turn) % len(upstreams)
            return upstreams[turn:] + upstreams[:turn]
        ordered = sorted(upstreams, key=_load)
        if policy != "prefix":
            return ordered
        digests = prefix_digests(endpoint, payload)
        if not digests:
            return ordered
        args = [
            int(time.time() * 1000),
            TABLE_SIZE,
            setting("TOLLGATE_ROUTING_LOAD_FACTOR"),
            digests,
            [[u.replica_id, u.outstanding, max(u.max_num_seqs, 1)] for u in upstreams],
        ]
        try:
            chosen = int(
                await self.pipe.evalsha(_ROUTE, route_keys(model_id), (orjson.dumps(args),))
            )
        except (redis.exceptions.RedisError, OSError, TimeoutError, ValueError):
            log.warning("prefix routing unavailable: least-loaded instead", exc_info=True)
            return ordered
        first = [u for u in ordered if u.replica_id == chosen]
        return first + [u for u in ordered if u.replica_id != chosen]
