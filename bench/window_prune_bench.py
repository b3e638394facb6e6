"""What a burst on one key costs the requests after it (issue 18): the rate window's pruning.

A key's 60 s window keeps one entry per admitted request. After a burst of 5,000 requests a
second for a minute (300,000 entries), the same key used at 3 requests a second finds about
1,667 expired entries per call; before limiter.lua bounded the removal (PRUNE_MAX per call,
the rest on later calls, never counted) each such call removed them all, ~4 ms a request.
This runs the gateway's real admission (``Limiter.admit``, limiter.lua on the real Redis)
with a simulated clock: 180 calls 1/3 s apart (the minute after the burst) against the
window the burst left, and the same 180 calls on an empty window, alternating rounds, and
reports per call the Redis CPU (``INFO commandstats``, evalsha) and the wall time at the
client.

    PYTHONPATH=. TOLLGATE_ENV=test .venv/bin/python bench/window_prune_bench.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import secrets
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("TOLLGATE_REDIS_PREFIX", f"wpbench-{secrets.token_hex(4)}")

import django  # noqa: E402

django.setup()

import redis.asyncio as aioredis  # noqa: E402
from django.conf import settings  # noqa: E402

from core.keyspace import pool_keys, rate_keys  # noqa: E402
from core.redis import get_redis  # noqa: E402
from gateway.limiter import Limiter, SlotRequest  # noqa: E402
from gateway.state import KeyInfo, Limits, TenantInfo  # noqa: E402

KEY_ID, TENANT_ID, MODEL = 990101, 990102, 990103
BURST_RATE, BURST_SECONDS, AFTER_RATE, CALLS = 5_000, 60, 3, 180
START = 1_800_000_000.0  # the burst's first second (simulated clock)

KEY = KeyInfo(
    id=KEY_ID,
    prefix="wpbench0",
    secret_hash="x",
    tenant_id=TENANT_ID,
    expires_at=0,
    limits=Limits(rpm=10_000_000, tpm=0),
    model_ids=frozenset(),
)
TENANT = TenantInfo(
    id=TENANT_ID,
    slug="wpbench",
    priority="P1",
    boost_until=0,
    weight=1,
    limits=Limits(),
    quota_period="monthly",
    quota_tokens=0,
    quota_money_nano=0,
    currency="USD",
    model_ids=frozenset(),
)
SLOT = SlotRequest(
    pool=pool_keys(MODEL),
    priority_index=1,
    weight=1,
    budget=1_000_000,
    p2_open=True,
    give_up_ms=10_000,
    lease_ms=60_000,
)


def wipe() -> None:
    get_redis().delete(*rate_keys(KEY_ID, TENANT_ID), *pool_keys(MODEL))


def seed_burst() -> None:
    """The window as the burst left it: BURST_RATE entries a second for BURST_SECONDS."""
    zset, hash_ = rate_keys(KEY_ID, TENANT_ID)[:2]
    total = BURST_RATE * BURST_SECONDS
    pipe = get_redis().pipeline(transaction=False)
    for begin in range(0, total, 5000):
        batch = range(begin, min(begin + 5000, total))
        pipe.zadd(zset, {f"b{i}": (START + i / BURST_RATE) * 1000 for i in batch})
        pipe.hset(hash_, mapping={f"b{i}": 10 for i in batch})
    pipe.hset(hash_, "_sum", total * 10)
    pipe.execute()


def evalsha_stats() -> tuple[int, int]:
    stats = get_redis().info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


async def minute_after(tag: str) -> list[float]:
    """CALLS admissions 1/AFTER_RATE s apart, starting when the burst ended; wall ms each."""
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    limiter = Limiter(client)
    walls = []
    try:
        for n in range(CALLS):
            at = START + BURST_SECONDS + n / AFTER_RATE
            began = time.perf_counter()
            decision = await limiter.admit(f"{tag}-{n}", KEY, TENANT, 10, 0, SLOT, {}, at)
            walls.append((time.perf_counter() - began) * 1000)
            assert decision.admitted, decision
    finally:
        await limiter.aclose()
        await client.aclose()
    return walls


def run(tag: str, burst: bool) -> tuple[float, float]:
    wipe()
    if burst:
        seed_burst()
    calls0, usec0 = evalsha_stats()
    walls = asyncio.run(minute_after(tag))
    calls1, usec1 = evalsha_stats()
    wipe()
    return (usec1 - usec0) / max(calls1 - calls0, 1), statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    print(
        f"`nproc` {os.cpu_count()}, `uname -m` {platform.machine()}, Python "
        f"{platform.python_version()}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    rows = {"after the burst": [], "no burst": []}
    for r in range(rounds):
        for name, burst in (("after the burst", True), ("no burst", False)):
            rows[name].append(run(f"r{r}{int(burst)}", burst))
    print("\n| window | Redis µs per admission (rounds) | median wall ms per admission (rounds) |")
    print("|---|---|---|")
    for name, got in rows.items():
        redis_us = ", ".join(f"{u:.0f}" for u, _ in got)
        walls = ", ".join(f"{w:.2f}" for _, w in got)
        print(f"| {name} | {redis_us} | {walls} |")
    extra = statistics.median(w for _, w in rows["after the burst"]) - statistics.median(
        w for _, w in rows["no burst"]
    )
    print(f"\nadded by the burst's tail, median wall: {extra:.2f} ms per admission")


if __name__ == "__main__":
    main()
