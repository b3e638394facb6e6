"""Abuse of the limits: bursts against a requests/min key and a money budget across two
gateway processes, a burst straddling the window edge, and a day of traffic's Redis keys."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
import time_machine
from django.conf import settings
from django.db.models import Sum

from core.keyspace import quota_key
from core.redis import get_redis
from gateway.admission import Admission, Claim
from gateway.limiter import Limiter
from gateway.state import KeyInfo, Limits, TenantInfo
from metering import ingest
from metering.models import UsageEvent
from metering.periods import period_id
from tests.faults.conftest import Gateway, build_world, chat_body, start_engine

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

# One P1 request's claim on model 1 with slots to spare: these tests are about the limits.
SLOT_CLAIM = Claim("any", 1, 10**6, "P1", tenant_id=1, weight=1, cost=0)


async def burst(url: str, key: str, n: int, body: dict) -> list[tuple[int, dict[str, str], bytes]]:
    """``n`` requests fired at once, each on its own connection."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = asyncio.Event()

        async def one() -> tuple[int, dict[str, str], bytes]:
            await start.wait()
            async with session.post(
                f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.sleep(0.2)
        start.set()
        return await asyncio.gather(*tasks)


def test_1000_concurrent_requests_on_a_60_rpm_key_admit_exactly_60(procs, gateway_env) -> None:
    engine = start_engine(
        procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0", "--max-num-seqs", "256"
    )
    world = build_world(
        engine.port,
        key_a_limits={"requests_per_minute": 60},
        tenant_a={"requests_per_minute": None, "max_concurrent_requests": None},
    )
    gw = Gateway(procs, gateway_env()).start().wait_ready(world.key_a)

    answers = asyncio.run(burst(gw.url, world.key_a, 1000, chat_body(max_tokens=4)))

    statuses = [status for status, _, _ in answers]
    assert statuses.count(200) == 60, {s: statuses.count(s) for s in set(statuses)}
    assert statuses.count(429) == 940
    for status, headers, body in answers:
        if status != 429:
            continue
        assert int(headers["retry-after"]) > 0, headers
        assert headers["x-ratelimit-remaining-requests"] == "0", headers
        assert b"rate_limit_exceeded" in body


def test_a_burst_straddling_the_window_edge_admits_at_most_60_in_any_60s(settings: object) -> None:
    """The limiter's clock is the process clock: moved with time_machine, not slept.
    A fixed-window limiter would admit 60 just before the edge and 60 just after."""
    admitted = asyncio.run(_edge_burst())
    admitted.sort()
    for i, t in enumerate(admitted):
        in_window = sum(1 for u in admitted[i:] if u < t + 60_000)
        assert in_window <= 60, f"{in_window} admitted in the 60 s from {t}"
    # Not vacuous: the window did move on (more than 60 over the whole run, 30 at each edge).
    assert len(admitted) == 90


async def _edge_burst() -> list[int]:
    client = aioredis.from_url(settings.REDIS_URL)
    limiter, admission = Limiter(client), Admission(client)
    key, tenant = _key_tenant(1, key_limits=Limits(rpm=60))
    admitted: list[int] = []
    t0 = datetime(2031, 3, 1, 11, 59, 0, tzinfo=UTC)

    async def attempt(at: datetime, n: int) -> None:
        with time_machine.travel(at, tick=False):
            decision = await limiter.admit(
                f"r{at.timestamp()}-{n}",
                key,
                tenant,
                10,
                0,
                admission.slot_request(SLOT_CLAIM),
                _record(key, tenant),
            )
            if decision.admitted:
                admitted.append(int(at.timestamp() * 1000))

    try:
        for n in range(30):  # 30 at the start of the window
            await attempt(t0 + timedelta(milliseconds=n), n)
        for ms in range(59_000, 61_000, 4):  # 500 attempts over the two seconds around the edge
            await attempt(t0 + timedelta(milliseconds=ms), ms)
    finally:
        await client.aclose()
    return admitted


NO_LIMITS = Limits()


def _key_tenant(
    n: int, key_limits: Limits = NO_LIMITS, tenant_limits: Limits = NO_LIMITS, quota_tokens: int = 0
) -> tuple[KeyInfo, TenantInfo]:
    tenant = TenantInfo(
        id=n,
        slug=f"t{n}",
        priority="P1",
        boost_until=0,
        weight=1,
        limits=tenant_limits,
        quota_period="daily",
        quota_tokens=quota_tokens,
        quota_money_nano=0,
        currency="USD",
        model_ids=frozenset({1}),
    )
    key = KeyInfo(
        id=n,
        prefix=f"k{n}",
        secret_hash="",
        tenant_id=n,
        expires_at=0,
        limits=key_limits,
        model_ids=frozenset(),
    )
    return key, tenant


def _record(key: KeyInfo, tenant: TenantInfo) -> dict:
    return {
        "event": {
            "request_id": "",
            "occurred_at": 0,
            "tenant_id": tenant.id,
            "api_key_id": key.id,
            "model_id": 1,
            "deployment_id": None,
            "endpoint": "chat",
            "priority": "P1",
            "price_id": None,
        },
        "price": None,
    }


def test_200_concurrent_requests_against_a_budget_for_20_overrun_it_by_at_most_one_reservation(
    procs,
    gateway_env,
) -> None:
    engine = start_engine(
        procs, ("sim-chat",), "--sim-ttft-ms", "5", "--sim-decode-tps", "0", "--max-num-seqs", "256"
    )
    # USD 100 / 1M input and 1,000 / 1M output tokens: one request reserves its prompt
    # estimate (body / 4 + 8 tokens) plus max_tokens=100, about USD 0.105.
    body = chat_body(max_tokens=100)
    world = build_world(
        engine.port,
        price=("100.00", "50.00", "1000.00"),
        tenant_a={
            "requests_per_minute": None,
            "max_concurrent_requests": None,
            "tokens_per_minute": None,
            "quota_amount": Decimal("2.1000"),
            "quota_period": "daily",
        },
    )
    gw = Gateway(procs, gateway_env()).start().wait_ready(world.key_a)
    prompt_est = len(orjson.dumps(body)) // 4 + 8
    reservation = Decimal(prompt_est * 100 + 100 * 1000) / 1_000_000
    assert 19 <= Decimal("2.1") / reservation <= 21  # the budget has room for about 20

    answers = asyncio.run(burst(gw.url, world.key_a, 200, body))

    statuses = [status for status, _, _ in answers]
    assert 0 < statuses.count(200) < 200, {s: statuses.count(s) for s in set(statuses)}
    assert all(b"insufficient_quota" in b for s, _, b in answers if s == 429)
    assert statuses.count(200) + statuses.count(429) == 200
    ingest.drain("faults", seconds=30)
    billed = UsageEvent.objects.filter(tenant=world.tenant_a).aggregate(c=Sum("cost"))["c"]
    assert UsageEvent.objects.filter(tenant=world.tenant_a, status="ok").count() == statuses.count(
        200
    )
    assert billed <= Decimal("2.1") + reservation, f"billed {billed} on a budget of 2.1"
    quota = get_redis().hgetall(quota_key(world.tenant_a.pk, period_id("daily", datetime.now(UTC))))
    assert int(quota[b"money_reserved"]) == 0 and int(quota[b"tokens_reserved"]) == 0, quota


def test_a_day_of_traffic_leaves_only_keys_that_expire_within_their_window(
    settings: object,
) -> None:
    """A simulated day (clock moved with time_machine) of admits and settles for 20 keys of 4
    tenants with every limit and a daily quota on. Afterwards every key under the prefix
    has a TTL no longer than its window, and the key count does not grow with traffic.

    Redis expires keys on its own (real) clock, so keys written during the simulated day
    all still exist at the end; what is checked is that each one *would* go within its
    window, and that per-scope structures (windows, in-flight sets) stay bounded."""
    counts = asyncio.run(_a_day(settings.TOLLGATE_REDIS_PREFIX))
    hour2, hour24, ttls = counts
    assert hour24["scoped"] == hour2["scoped"], (hour2, hour24)  # nothing accumulates per scope
    assert hour24["largest"] <= 60, hour24  # a window holds at most its rpm's worth of entries
    kinds = {k.split(":")[1] for k, _, _ in ttls}
    assert {"rl", "quota", "settled"} <= kinds, kinds  # the day did leave keys to check
    problems = [(k, ttl, limit) for k, ttl, limit in ttls if not 0 < ttl <= limit]
    assert not problems, problems[:20]


WINDOWS_MS = {  # key kind -> the longest life it may have
    "rl": 60_000,
    "cc": 15 * 60_000,
    "quota": None,
    "settled": 3_600_000,
    "adm": 3_600_000,
    "gw": None,
}


async def _a_day(prefix: str) -> tuple[dict, dict, list[tuple[str, int, int]]]:
    from core.keyspace import QUOTA_TTL_SECONDS

    client = aioredis.from_url(settings.REDIS_URL)
    limiter, admission = Limiter(client), Admission(client)
    scopes = [
        _key_tenant(
            100 + i,
            Limits(rpm=30, tpm=50_000, concurrent=4),
            Limits(rpm=100, tpm=200_000, concurrent=10),
            quota_tokens=10**9,
        )
        for i in range(20)
    ]
    # Four tenants, five keys each.
    scopes = [
        (
            k,
            _key_tenant(
                100 + (i % 4),
                tenant_limits=Limits(rpm=100, tpm=200_000, concurrent=10),
                quota_tokens=10**9,
            )[1],
        )
        for i, (k, _) in enumerate(scopes)
    ]
    start = datetime(2031, 5, 1, 0, 0, tzinfo=UTC)
    snapshots: dict[int, dict] = {}
    n = 0
    try:
        with time_machine.travel(start, tick=False) as traveller:
            for minute in range(24 * 60):
                now = start + timedelta(minutes=minute)
                traveller.move_to(now)
                for key, tenant in scopes[minute % 5 :: 5]:  # every key every 5 minutes
                    for _ in range(3):
                        n += 1
                        rid = f"day-{n}"
                        slot = admission.slot_request(SLOT_CLAIM)
                        decision = await limiter.admit(
                            rid, key, tenant, 500, 0, slot, _record(key, tenant)
                        )
                        if decision.admitted:
                            await limiter.settle(decision.reservation, 120, 0, b"", 1)
                if minute in (2 * 60, 24 * 60 - 1):
                    snapshots[minute] = await _census(client, prefix)
        ttls = []
        async for raw in client.scan_iter(f"{prefix}:*", count=1000):
            name = raw.decode()
            kind = name[len(prefix) + 1 :].split(":")[0]
            if name.endswith(":usage:events"):
                continue  # the usage stream: trimmed by the metering consumer, not by TTL
            limit = WINDOWS_MS.get(kind, 0)
            if kind == "quota":
                limit = QUOTA_TTL_SECONDS * 1000
            if limit is None:
                limit = 0  # open-request records: must be gone once everything settled
            ttls.append((name, await client.pttl(name), limit))
    finally:
        await client.aclose()
    return snapshots[2 * 60], snapshots[24 * 60 - 1], ttls


async def _census(client: aioredis.Redis, prefix: str) -> dict:
    """Keys that belong to a scope (not to one request), and the largest one's size."""
    scoped, largest = 0, 0
    async for raw in client.scan_iter(f"{prefix}:*", count=1000):
        name = raw.decode()
        kind = name[len(prefix) + 1 :].split(":")[0]
        if kind in ("settled",) or name.endswith(":usage:events"):
            continue
        scoped += 1
        kind_type = (await client.type(name)).decode()
        if kind == "rl" and kind_type == "zset":
            largest = max(largest, await client.zcard(name))
    return {"scoped": scoped, "largest": largest}
