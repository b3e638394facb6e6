"""Metering benchmark: ingestion throughput (events/s into PostgreSQL) and CSV export rate
and peak memory, on its own database and Redis prefix.

    .venv/bin/python bench/metering_ingest.py [--events 1000000] [--consumers 2]

Creates (and at the end drops) the database ``tollgate_bench_metering``; the events go
through the real path: XADD pipelines into the stream, ``manage.py consume_usage``
processes into PostgreSQL (events + hourly rollups in the same transaction). Every event
gets its own rollup bucket (key x hour), the worst case for rollups, so the hourly export
has exactly one row per event; the export then runs in a fresh process for 100k and for
all rows and reports rows/s and peak RSS.
"""

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DB = "tollgate_bench_metering"
PREFIX = "tollgate-bench-metering"
KEYS = 1000
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def env() -> dict[str, str]:
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate")
    return {
        **os.environ,
        "DATABASE_URL": base.rsplit("/", 1)[0] + f"/{DB}",
        "TOLLGATE_REDIS_PREFIX": PREFIX,
        "DJANGO_SETTINGS_MODULE": "config.settings",
    }


def setup_django() -> None:
    os.environ.update(env())
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def psql(sql: str) -> None:
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", sql], check=True)


def prepare() -> None:
    psql(f"DROP DATABASE IF EXISTS {DB}")
    psql(f"CREATE DATABASE {DB}")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env(), check=True)


def seed() -> tuple[list[int], list[int], int]:
    from decimal import Decimal

    from deployments.models import CatalogModel
    from metering.models import Price
    from tenants.models import ApiKey, Tenant

    tenants = [Tenant.objects.create(name=f"T{i}", slug=f"t{i}") for i in range(10)]
    keys = ApiKey.objects.bulk_create(
        ApiKey(tenant=tenants[i % 10], name=f"k{i}", prefix=f"{i:08d}", secret_hash="x")
        for i in range(KEYS)
    )
    model = CatalogModel.objects.create(
        served_name="bench-8b", source="bench/8b", params_billions=Decimal("8"), context_length=8192
    )
    Price.objects.create(
        model=model,
        input_per_mtok=Decimal("0.2"),
        cached_input_per_mtok=Decimal("0.1"),
        output_per_mtok=Decimal("0.6"),
        effective_from=T0 - timedelta(days=1),
    )
    return [k.pk for k in keys], [k.tenant_id for k in keys], model.pk


def produce(n: int, keys: list[int], tenants: list[int], model: int) -> float:
    from core.keyspace import usage_stream
    from core.redis import get_redis
    from core.usage import FIELD, UsageRecord

    client, stream, started = get_redis(), usage_stream(), time.monotonic()
    for chunk in range(0, n, 10_000):
        pipe = client.pipeline(transaction=False)
        for i in range(chunk, min(chunk + 10_000, n)):
            k = i % KEYS
            pipe.xadd(
                stream,
                {
                    FIELD: UsageRecord(
                        request_id=f"bench-{i}",
                        occurred_at=(T0 + timedelta(hours=i // KEYS)).timestamp(),
                        tenant_id=tenants[k],
                        api_key_id=keys[k],
                        model_id=model,
                        deployment_id=None,
                        endpoint="chat",
                        priority="P1",
                        prompt_tokens=500 + i % 700,
                        cached_tokens=i % 100,
                        completion_tokens=100 + i % 300,
                        reasoning_tokens=0,
                        status="ok",
                        http_status=200,
                        latency_ms=300,
                        ttft_ms=40,
                        price_id=None,
                    ).encode()
                },
            )
        pipe.execute()
    return time.monotonic() - started


def ingest(n: int, consumers: int) -> float:
    from core.keyspace import usage_stream
    from core.redis import get_redis
    from metering import ingest as metering_ingest

    metering_ingest.ensure_group()
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "manage.py", "consume_usage", "--batch", "2000", "--block-ms", "100"],
            cwd=ROOT,
            env={**env(), "TOLLGATE_LOG_LEVEL": "WARNING"},
        )
        for _ in range(consumers)
    ]
    client = get_redis()
    while True:
        (group,) = client.xinfo_groups(usage_stream())
        if group["pending"] == 0 and group["lag"] == 0:
            break
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    for p in procs:
        p.terminate()
        p.wait()
    return elapsed


def export_child(hours: int) -> None:
    """In a fresh process: stream the hourly showback export of ``hours`` hours."""
    setup_django()
    from metering import export

    q = export.ExportQuery(start=T0, end=T0 + timedelta(hours=hours), granularity="hour")
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started, size, lines = time.monotonic(), 0, 0
    for chunk in export.csv_lines(q):
        size += len(chunk)
        lines += chunk.count("\n")
    elapsed = time.monotonic() - started
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{base_mb:.1f} {lines - 1} {elapsed:.2f} {size} {rss_mb:.1f}")


def export(hours: int) -> tuple[float, int, float, int, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--export-child", str(hours)],
        cwd=ROOT,
        env=env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    base, rows, secs, size, rss = out[-5:]
    return float(base), int(rows), float(secs), int(size), float(rss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="Keep the benchmark database.")
    parser.add_argument("--export-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export_child:
        return export_child(args.export_child)
    prepare()
    setup_django()
    from django.db import connection

    from core.redis import get_redis
    from metering.models import UsageEvent, UsageRollup

    try:
        keys, tenants, model = seed()
        n = args.events
        produced = produce(n, keys, tenants, model)
        print(f"XADD: {n} events in {produced:.1f}s ({n / produced:,.0f}/s)")
        took = ingest(n, args.consumers)
        stored, rollups = UsageEvent.objects.count(), UsageRollup.objects.count()
        assert stored == n, (stored, n)
        print(
            f"ingest: {n} events in {took:.1f}s = {n / took:,.0f} events/s "
            f"({args.consumers} consumers, {rollups} rollup rows)"
        )
        hours = n // KEYS
        for h in (hours // 10, hours):
            base, rows, secs, size, rss = export(h)
            print(
                f"export: {rows} rows, {size / 1e6:.0f} MB in {secs:.1f}s = "
                f"{rows / secs:,.0f} rows/s, peak RSS {rss:.0f} MB "
                f"(process before exporting: {base:.0f} MB)"
            )
        print(f"machine: nproc={os.cpu_count()} {platform.machine()} {datetime.now(UTC):%Y-%m-%d}")
    finally:
        connection.close()
        client = get_redis()
        for key in client.scan_iter(f"{PREFIX}:*"):
            client.delete(key)
        if not args.keep:
            psql(f"DROP DATABASE IF EXISTS {DB}")


if __name__ == "__main__":
    main()
