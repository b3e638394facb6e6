"""Kept ``/v1/responses`` answers: per tenant, in Redis at once and in PostgreSQL for good.

Why both: a client chains its next turn (``previous_response_id``) the moment it has read
``response.completed``, and that turn may land on any gateway process of any node. So the
gateway sends the record's write to Redis (one Lua call: the record with a TTL, and an entry
on the ``responses:log`` stream) *before* the final event or body goes out, without waiting for
Redis's reply (the round trip is not in the client's way); every process reads it from
there. The stream's consumer (``persist``, a Celery beat task) writes the rows to
PostgreSQL idempotently and acknowledges only after the commit, like the usage stream, so the
gateway never touches the ORM on the request path and a crash loses nothing Redis kept (AOF).
A Redis miss (TTL passed, Redis rebuilt) falls back to PostgreSQL; a delete leaves a
tombstone in Redis so a row the consumer has not deleted yet is never served.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from django.conf import settings
from django.db import close_old_connections, transaction

from core.keyspace import responses_log, stored_response_key
from core.redis import get_redis
from gateway.redispipe import RedisPipe, Script, encode_script_call

log = logging.getLogger("tollgate.gateway")

TOMBSTONE = b"-"
GROUP = "persist"
# One call per write, on the gateway's pipelined connection: the record (or a delete's
# tombstone) with its TTL, and the stream entry for PostgreSQL, atomically.
WRITE = Script(
    """
redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
if ARGV[1] == 'put' then
  redis.call('XADD', KEYS[2], '*', 'op', 'put', 'r', ARGV[2])
else
  redis.call('XADD', KEYS[2], '*', 'op', 'del', 't', ARGV[4], 'id', ARGV[5])
end
return 1
"""
)


# Pauses before a chained turn's previous response is declared unknown (seconds, in all
# 0.35: longer than a TCP retransmission on a healthy network, short for a 404).
CHAIN_RETRIES = (0.05, 0.1, 0.2)


_RETRIES: set[asyncio.Task] = set()  # writes sent again, held until they finish


def ttl() -> int:
    return settings.TOLLGATE_RESPONSES_CACHE_SECONDS


# --- The gateway's side (async, Redis first) ------------------------------------------------


class ResponseStore:
    """What one gateway process reads and writes: ``client`` is its async Redis client,
    ``pipe`` its pipelined connection for the per-request calls."""

    def __init__(self, client: aioredis.Redis, pipe: RedisPipe) -> None:
        self.redis = client
        self.pipe = pipe

    async def put(self, record: dict[str, Any]) -> None:
        """Keep a finished response (readable by every process once this returns)."""
        key = stored_response_key(record["tenant_id"], record["id"])
        # No asyncio.timeout here: the pipe fails a call Redis leaves unanswered after its
        # own call timeout (5 s), and a timeout context per call costs the reply ~10-20 µs.
        await self.pipe.evalsha(
            WRITE, (key, responses_log()), (b"put", orjson.dumps(record), ttl()), keep_keys=False
        )

    async def start_put(self, record: dict[str, Any]) -> None:
        """Keep a finished response without waiting for Redis's reply: the write is on its
        way to Redis when this returns, ahead of the answer the caller sends its client next,
        so Redis has it before the client can chain from it (a chained turn that still finds
        nothing looks again: ``get_chained``). Nothing waits for the reply, so the request's
        settle follows in the same round trip; a failed write is logged when the reply comes
        (the answer is delivered and billed regardless)."""
        key = stored_response_key(record["tenant_id"], record["id"])
        args = (b"put", orjson.dumps(record), ttl())
        command = encode_script_call(WRITE.sha, (key, responses_log()), args, keep_keys=False)
        reply = await self.pipe.send_now(command)
        reply.add_done_callback(lambda done: self._written(done, record))

    def _written(self, reply: asyncio.Future, record: dict[str, Any]) -> None:
        if reply.cancelled() or reply.exception() is None:
            return
        error = reply.exception()
        if isinstance(error, redis.exceptions.ResponseError) and str(error).startswith("NOSCRIPT"):
            # Redis lost its scripts (a restart): EVAL loads it again.
            task = asyncio.ensure_future(self._put_again(record))
            _RETRIES.add(task)
            task.add_done_callback(_RETRIES.discard)
            return
        log.error("could not keep response %s: %s", record["id"], error)

    async def _put_again(self, record: dict[str, Any]) -> None:
        try:
            await self.put(record)
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            log.error("could not keep response %s: %s", record["id"], exc)

    async def get_chained(self, tenant_id: int, response_id: str) -> dict[str, Any] | None:
        """The response a new turn chains from. Its write left for Redis before the client
        had the answer, but over a network the client's next request can still overtake it
        (a retransmitted packet), so a miss looks again for a moment before it is final."""
        for pause in CHAIN_RETRIES:
            record = await self.get(tenant_id, response_id)
            if record is not None:
                return record
            await asyncio.sleep(pause)
        return await self.get(tenant_id, response_id)

    async def delete(self, tenant_id: int, response_id: str) -> None:
        key = stored_response_key(tenant_id, response_id)
        args = (b"del", TOMBSTONE, ttl(), tenant_id, response_id)
        await self.pipe.evalsha(WRITE, (key, responses_log()), args, keep_keys=False)

    async def get(self, tenant_id: int, response_id: str) -> dict[str, Any] | None:
        return (await self.get_many(tenant_id, [response_id])).get(response_id)

    async def get_many(self, tenant_id: int, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The tenant's kept responses among ``ids`` (deleted and unknown ones left out)."""
        if not ids:
            return {}
        async with asyncio.timeout(5.0):
            raws = await self.redis.mget([stored_response_key(tenant_id, i) for i in ids])
        found, missing = {}, []
        for response_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                missing.append(response_id)
            elif raw != TOMBSTONE:
                found[response_id] = orjson.loads(raw)
        if missing:
            rows = await asyncio.to_thread(_load_rows, tenant_id, missing)
            found.update(rows)
            await self._recache(tenant_id, rows)
        return found

    async def _recache(self, tenant_id: int, rows: dict[str, dict[str, Any]]) -> None:
        if not rows:
            return
        pipe = self.redis.pipeline(transaction=False)
        for response_id, record in rows.items():
            # NX: a delete that raced this read left a tombstone; keep it.
            pipe.set(
                stored_response_key(tenant_id, response_id), orjson.dumps(record), ex=ttl(), nx=True
            )
        try:
            async with asyncio.timeout(2.0):
                await pipe.execute()
        except Exception:  # noqa: BLE001 - only a cache
            log.warning("could not re-cache stored responses", exc_info=True)


def _load_rows(tenant_id: int, ids: list[str]) -> dict[str, dict[str, Any]]:
    from gateway.models import StoredResponse

    close_old_connections()
    try:
        rows = StoredResponse.objects.filter(tenant_id=tenant_id, response_id__in=ids)
        return {row.response_id: as_record(row) for row in rows}
    finally:
        close_old_connections()


def as_record(row: Any) -> dict[str, Any]:
    """A StoredResponse row in the record shape the gateway writes to Redis."""
    return {
        "id": row.response_id,
        "tenant_id": row.tenant_id,
        "api_key_id": row.api_key_id,
        "model": row.model,
        "status": row.status,
        "created_at": int(row.created_at.timestamp()),
        "previous_response_id": row.previous_response_id or None,
        "chain": row.chain,
        "input": row.input_items,
        "response": row.response,
    }


# --- The consumer: stream -> PostgreSQL (sync, in the worker) ---------------------------------


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis) -> None:
    try:
        client.xgroup_create(responses_log(), GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _read(client: redis.Redis, consumer: str, count: int, claim_idle_ms: int) -> list:
    stream = responses_log()
    own = client.xreadgroup(GROUP, consumer, {stream: "0"}, count=count)
    if own and own[0][1]:
        return own[0][1]
    claimed = client.xautoclaim(stream, GROUP, consumer, claim_idle_ms, "0-0", count=count)
    if claimed and claimed[1]:
        return claimed[1]
    new = client.xreadgroup(GROUP, consumer, {stream: ">"}, count=count)
    return new[0][1] if new else []


def _apply(fields: dict[bytes, bytes]) -> None:
    """One stream entry, applied idempotently (a redelivered entry changes nothing)."""
    from gateway.models import StoredResponse
    from tenants.models import ApiKey, Tenant

    op = fields.get(b"op")
    if op == b"del":
        StoredResponse.objects.filter(
            tenant_id=int(fields[b"t"]), response_id=fields[b"id"].decode()
        ).delete()
        return
    if op != b"put":
        raise ValueError(f"unknown operation {op!r}")
    r = orjson.loads(fields[b"r"])
    if not Tenant.objects.filter(pk=r["tenant_id"]).exists():
        return  # the tenant is gone, and its responses with it
    key_id = r.get("api_key_id")
    if key_id is not None and not ApiKey.objects.filter(pk=key_id).exists():
        key_id = None
    StoredResponse.objects.update_or_create(
        tenant_id=r["tenant_id"],
        response_id=r["id"],
        defaults={
            "api_key_id": key_id,
            "model": r["model"],
            "status": r["status"],
            "created_at": datetime.fromtimestamp(r["created_at"], UTC),
            "previous_response_id": r.get("previous_response_id") or "",
            "chain": r.get("chain") or [],
            "input_items": r["input"],
            "response": r["response"],
        },
    )


def persist_once(consumer: str, count: int = 200, claim_idle_ms: int = 30_000) -> int:
    """Write one batch to PostgreSQL in one transaction, then acknowledge it; the entries
    written (0: nothing was waiting)."""
    client = get_redis()
    entries = _read(client, consumer, count, claim_idle_ms)
    if not entries:
        return 0
    with transaction.atomic():
        for entry_id, fields in entries:
            if not fields:
                continue  # trimmed meanwhile
            try:
                with transaction.atomic():
                    _apply(fields)
            except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
                log.error("dropping malformed stored-response entry %s", entry_id)
    ids = [entry_id for entry_id, _ in entries]
    pipe = client.pipeline(transaction=True)
    pipe.xack(responses_log(), GROUP, *ids)
    pipe.xdel(responses_log(), *ids)
    pipe.execute()
    return len(entries)


def persist(consumer: str, seconds: float) -> int:
    """Drain the stream into PostgreSQL for up to ``seconds`` (the Celery task)."""
    ensure_group(get_redis())
    deadline, written = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        batch = persist_once(consumer)
        written += batch
        if not batch:
            break
    return written


def expire(now: datetime | None = None, batch: int = 1000) -> int:
    """Delete the kept responses older than the retention period, a batch at a time (a
    large backlog never holds one long transaction); returns how many went. Their Redis
    copies expire sooner (TOLLGATE_RESPONSES_CACHE_SECONDS)."""
    from gateway.models import StoredResponse

    days = settings.TOLLGATE_RESPONSES_RETENTION_DAYS
    if days <= 0:
        return 0
    cutoff = (now or datetime.now(UTC)) - timedelta(days=days)
    gone = 0
    while True:
        ids = list(
            StoredResponse.objects.filter(created_at__lt=cutoff).values_list("pk", flat=True)[
                :batch
            ]
        )
        if not ids:
            return gone
        gone += StoredResponse.objects.filter(pk__in=ids).delete()[0]
