"""What keeping a /v1/responses answer costs the reply: the write-through before the final
event or body goes out (gateway/response_store.py), alone, against the real Redis.

Three ways of writing the same record (a 16-token Response object, as the gateway bench's
engines answer), each timed per call at c=1 (one write at a time, as one client's turn):

  multi      redis-py MULTI pipeline: SET with TTL + XADD (the first version)
  lua        one Lua call on the gateway's pipelined connection, the response dict
             serialised again, in an asyncio.timeout (main at 0a14f94)
  store.put  ResponseStore.put as it is now: the engine's JSON kept as bytes
             (orjson.Fragment), no timeout context (the pipe has its own), the record's
             one-off key not kept among the pipe's encoded keys

Rounds alternate the order of the three; the median of each round is printed. Writes go
under a Redis prefix of its own, removed at the end.

    PYTHONPATH=. TOLLGATE_ENV=test .venv/bin/python bench/responses_keep_bench.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ["TOLLGATE_REDIS_PREFIX"] = f"keepbench-{secrets.token_hex(4)}"
django.setup()

import orjson  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from django.conf import settings  # noqa: E402

from core.keyspace import responses_log, stored_response_key  # noqa: E402
from gateway.redispipe import RedisPipe  # noqa: E402
from gateway.response_store import WRITE, ResponseStore, ttl  # noqa: E402

RAW = orjson.dumps(
    {
        "id": "resp_bench",
        "object": "response",
        "created_at": 1,
        "model": "bench-model",
        "status": "completed",
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "word " * 16, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 16,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 26,
        },
        "instructions": None,
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_output_tokens": 16,
        "previous_response_id": None,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
    }
)
PARSED = orjson.loads(RAW)


def record(n: int, as_bytes: bool) -> dict:
    return {
        "id": f"resp_{n}",
        "tenant_id": 1,
        "api_key_id": 1,
        "model": "bench-model",
        "status": "completed",
        "created_at": 1,
        "previous_response_id": None,
        "chain": [],
        "input": [
            {
                "id": "msg_a",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say something."}],
                "status": "completed",
            }
        ],
        "response": orjson.Fragment(RAW) if as_bytes else PARSED,
    }


async def multi(client: aioredis.Redis, pipe: RedisPipe, n: int) -> None:
    rec = record(n, False)
    raw = orjson.dumps(rec)
    p = client.pipeline(transaction=True)
    p.set(stored_response_key(rec["tenant_id"], rec["id"]), raw, ex=ttl())
    p.xadd(responses_log(), {b"op": b"put", b"r": raw})
    async with asyncio.timeout(5.0):
        await p.execute()


async def lua(client: aioredis.Redis, pipe: RedisPipe, n: int) -> None:
    rec = record(n, False)
    key = stored_response_key(rec["tenant_id"], rec["id"])
    async with asyncio.timeout(5.0):
        await pipe.evalsha(WRITE, (key, responses_log()), (b"put", orjson.dumps(rec), ttl()))


async def main(calls: int, rounds: int) -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    pipe = RedisPipe.from_url(settings.REDIS_URL)
    store = ResponseStore(client, pipe)

    async def put(client: aioredis.Redis, pipe: RedisPipe, n: int) -> None:
        await store.put(record(n, True))

    ways = {"multi": multi, "lua": lua, "store.put": put}
    medians: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for r in range(rounds):
            order = list(ways)[r % 3 :] + list(ways)[: r % 3]
            for name in order:
                times = []
                for n in range(calls):
                    t = time.perf_counter()
                    await ways[name](client, pipe, r * calls + n)
                    times.append(time.perf_counter() - t)
                medians[name].append(statistics.median(times) * 1e6)
    finally:
        prefix = responses_log().split(":")[0]
        keys = [k async for k in client.scan_iter(f"{prefix}:*", count=1000)]
        for i in range(0, len(keys), 1000):
            await client.delete(*keys[i : i + 1000])
        await pipe.aclose()
        await client.aclose()
    base = statistics.median(medians["lua"])
    print(f"load average {os.getloadavg()[0]:.1f}; {calls} calls a round, {rounds} rounds")
    for name, values in medians.items():
        mid = statistics.median(values)
        rounds_text = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:<10} median {mid:6.1f} µs  ({mid / base:.2f}× lua)  rounds: {rounds_text}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    asyncio.run(main(a.calls, a.rounds))
