"""Outages under load: Redis stopped, PostgreSQL unreachable for 60 s, the gateway killed
with SIGKILL in the middle of 100 streams. What the tenant sees and what gets billed."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
import httpx
import orjson
import pytest

from core.changes import publish_change
from core.keyspace import quota_key, usage_stream
from core.redis import get_redis
from metering import ingest
from metering.models import UsageEvent
from metering.periods import period_id
from tests.databases import database_url
from tests.faults.conftest import (
    Gateway,
    build_world,
    chat_body,
    start_engine,
    wait_for,
)
from tests.metering.test_consumer_process import Proxy

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

UNLIMITED_TENANT = {
    "requests_per_minute": None,
    "max_concurrent_requests": None,
    "tokens_per_minute": None,
}


@dataclass
class Answer:
    at: float
    status: int
    request_id: str
    body: bytes


@dataclass
class Load:
    """A few clients sending requests back to back until stopped (bounded by ``until``)."""

    url: str
    key: str
    clients: int = 4
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, until: float) -> None:
        def client() -> None:
            with httpx.Client(timeout=15) as http:
                while not self.stop.is_set() and time.monotonic() < until:
                    try:
                        r = http.post(
                            f"{self.url}/v1/chat/completions",
                            json=chat_body(max_tokens=4),
                            headers={"Authorization": f"Bearer {self.key}"},
                        )
                        self.answers.append(
                            Answer(
                                time.monotonic(),
                                r.status_code,
                                r.headers.get("x-request-id", ""),
                                r.content,
                            )
                        )
                    except httpx.HTTPError as exc:
                        self.answers.append(Answer(time.monotonic(), 0, "", repr(exc).encode()))
                        time.sleep(0.05)

        self.threads = [threading.Thread(target=client, daemon=True) for _ in range(self.clients)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def between(self, start: float, end: float) -> list[Answer]:
        return [a for a in self.answers if start <= a.at < end]

    def ok_ids(self) -> set[str]:
        return {a.request_id for a in self.answers if a.status == 200}


def stream_request_ids() -> list[str]:
    entries = get_redis().xrange(usage_stream())
    return [orjson.loads(fields[b"e"])["request_id"] for _, fields in entries]


def test_redis_stopped_under_load_fails_closed_and_recovers_by_itself(
    procs, gateway_env, own_redis
) -> None:
    """The gateway's Redis is this test's own redis-server, killed with SIGKILL and restarted
    on the same port and data directory (AOF), without touching the gateway."""
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port, tenant_a=UNLIMITED_TENANT)
    gw = Gateway(procs, gateway_env(REDIS_URL=own_redis.url)).start().wait_ready(world.key_a)
    load = Load(gw.url, world.key_a)
    load.run(until=time.monotonic() + 120)
    try:
        time.sleep(3)
        killed = time.monotonic()
        own_redis.kill9()
        time.sleep(8)
        restarted = time.monotonic()
        own_redis.start()
        wait_for(
            lambda: any(a.status == 200 for a in load.between(restarted, 1e12)),
            30,
            "a successful request after Redis came back",
        )
        time.sleep(2)
    finally:
        load.finish()

    before = load.between(0, killed)
    assert before and all(a.status == 200 for a in before), {a.status for a in before}
    # Down: after a second for the requests already admitted, every answer is a clear 503.
    down = load.between(killed + 1, restarted)
    assert len(down) >= 10, "the gateway stopped answering while Redis was down"
    wrong = [(a.status, a.body[:200]) for a in down if a.status != 503]
    assert not wrong, wrong[:5]
    for a in down:
        error = orjson.loads(a.body)["error"]
        assert error["code"] == "service_unavailable" and "rate-limit store" in error["message"]
    # Back: it recovered by itself; the tail of the run is all successes.
    assert all(a.status == 200 for a in load.between(restarted + 10, 1e12))
    # Nothing admitted unmetered: every success has exactly one usage event (requests that
    # were running when Redis went settle once it is back).
    wait_for(lambda: set(stream_request_ids()) >= load.ok_ids(), 15, "every success's usage event")
    ids = stream_request_ids()
    assert len(ids) == len(set(ids))
    assert set(ids) == load.ok_ids()


@pytest.mark.slow
def test_postgresql_unreachable_for_60s_the_gateway_serves_and_usage_lands_afterwards(
    procs,
    gateway_env,
    redis_namespace,
) -> None:
    """The shared PostgreSQL is never stopped: the gateway and the usage consumer reach it
    through a TCP proxy on a loopback port, which the test closes for 60 s (refusing new
    connections and cutting open ones, as a stopped server does) and reopens on the same
    port. During the outage the gateway's snapshot reloads (forced by an invalidation) and
    its key-use writes fail; it keeps serving from its cache."""
    engine = start_engine(procs, ("sim-chat",), "--sim-ttft-ms", "1", "--sim-decode-tps", "0")
    world = build_world(engine.port, tenant_a=UNLIMITED_TENANT)
    from django.db import connection

    db = connection.settings_dict
    proxy = Proxy((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
    proxy.start()
    db_url = database_url("127.0.0.1", proxy.port)
    gw = Gateway(procs, gateway_env(DATABASE_URL=db_url)).start().wait_ready(world.key_a)
    consumer = procs.spawn(
        "consumer",
        [
            sys.executable,
            "manage.py",
            "consume_usage",
            "--block-ms",
            "200",
            "--claim-idle-ms",
            "500",
        ],
        gateway_env(DATABASE_URL=db_url),
    )
    load = Load(gw.url, world.key_a, clients=3)
    load.run(until=time.monotonic() + 150)
    try:
        time.sleep(3)
        wait_for(lambda: UsageEvent.objects.count() > 0, 20, "usage stored before the outage")
        proxy.stop()
        down_at = time.monotonic()
        time.sleep(1)
        stored_at_outage = UsageEvent.objects.count()
        publish_change("tenant", world.tenant_a.pk)  # every gateway worker tries to reload now
        time.sleep(59)
        stored_after_outage = UsageEvent.objects.count()
        proxy.start()
        up_at = time.monotonic()
        time.sleep(3)
    finally:
        load.finish()
    try:
        down = load.between(down_at, up_at)
        assert len(down) >= 100, len(down)
        failed = [(a.status, a.body[:200]) for a in down if a.status != 200]
        # The gateway's log says why (a worker restarted? a connection cut?) if this fails.
        assert not failed, (failed[:5], gw.log()[-4000:])
        assert stored_after_outage == stored_at_outage  # usage waited in Redis
        ok = load.ok_ids()
        wait_for(
            lambda: UsageEvent.objects.filter(tenant=world.tenant_a).count() >= len(ok),
            60,
            "the waiting usage to land",
        )
        ledger = list(
            UsageEvent.objects.filter(tenant=world.tenant_a).values_list("request_id", flat=True)
        )
        assert len(ledger) == len(set(ledger)) == len(ok)
        assert set(ledger) == ok
        assert b"database unavailable" in consumer.log_path.read_bytes()
        assert consumer.poll() is None and gw.proc.poll() is None
    finally:
        proxy.stop()


async def _streams(
    url: str, key: str, n: int, body: dict, progress: dict[str, int], stop_reading: asyncio.Event
) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as s:

        async def one(i: int) -> None:
            try:
                async with s.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ) as r:
                    assert r.status == 200, await r.text()
                    rid = r.headers["x-request-id"]
                    progress[rid] = 0
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            chunk = orjson.loads(line[6:])
                            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                                progress[rid] += 1
            except (TimeoutError, aiohttp.ClientError):
                pass  # the gateway died under us

        await asyncio.gather(*(one(i) for i in range(n)))


def test_kill_9_of_the_gateway_during_100_streams_bills_each_delivered_request_once(
    procs,
    gateway_env,
) -> None:
    """100 streams at 10 tokens/s each; once every one has delivered 20 tokens, SIGKILL to the
    gunicorn master and both workers. A new gateway starts; the beat task that reaps
    orphaned requests (``gateway.reap_orphans``, every 10 s in production) is run here in a
    loop, then the usage consumer's ingestion."""
    engine = start_engine(
        procs,
        ("sim-chat",),
        "--sim-ttft-ms",
        "5",
        "--sim-decode-tps",
        "10",
        "--sim-bandwidth-alpha",
        "0",
        "--sim-output-tokens-min",
        "300",
        "--sim-output-tokens-max",
        "300",
        "--max-num-seqs",
        "256",
    )
    world = build_world(
        engine.port, tenant_a={**UNLIMITED_TENANT, "quota_tokens": 10**9, "quota_period": "daily"}
    )
    env = gateway_env(TOLLGATE_GATEWAY_LEASE_SECONDS="3")
    gw = Gateway(procs, env).start().wait_ready(world.key_a)
    progress: dict[str, int] = {}

    def run() -> None:
        asyncio.run(
            _streams(
                gw.url,
                world.key_a,
                100,
                chat_body(max_tokens=300, stream=True),
                progress,
                asyncio.Event(),
            )
        )

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    wait_for(
        lambda: len(progress) == 100 and min(progress.values()) >= 20,
        60,
        "100 streams with 20 tokens each",
    )
    gw.kill9()
    reader.join(timeout=30)
    delivered = dict(progress)
    assert all(n >= 20 for n in delivered.values())

    Gateway(procs, env).start().wait_ready(
        world.key_a
    )  # the restarted gateway (a fresh process, nothing carried over)
    from gateway import tasks

    def all_billed() -> bool:
        tasks.reap_orphans()
        return set(stream_request_ids()) >= set(delivered)

    try:
        wait_for(all_billed, 45, "every delivered request to be billed")
    finally:
        ingest.drain("faults", seconds=30)
    rows = {e.request_id: e for e in UsageEvent.objects.filter(request_id__in=delivered)}
    assert set(rows) == set(delivered)
    ids = stream_request_ids()
    assert len(ids) == len(set(ids)), "a request was billed twice"
    for rid, tokens in delivered.items():
        # Billed up to the last checkpoint (about a second's worth behind), never more than
        # the client received.
        assert 0 < rows[rid].completion_tokens <= tokens, (rid, rows[rid].completion_tokens, tokens)
        assert rows[rid].completion_tokens >= tokens - 25, (
            rid,
            rows[rid].completion_tokens,
            tokens,
        )
    quota = get_redis().hgetall(quota_key(world.tenant_a.pk, period_id("daily", datetime.now(UTC))))
    assert int(quota[b"tokens_reserved"]) == 0, quota
