"""Usage ingestion: the Redis stream into PostgreSQL, nothing lost and nothing counted twice.

A consumer of the group ``metering`` reads a batch, prices it, and in ONE transaction
inserts the events (``ON CONFLICT (request_id) DO NOTHING``), adds only the rows really
inserted to the rollups, and stores malformed entries as dead letters. It acknowledges
the entries only after that commit. So:

- a consumer killed before the commit leaves its entries pending; it (after a restart, as
  its own pending list) or another consumer (``XAUTOCLAIM`` once idle) takes them again;
- a consumer killed after the commit but before ``XACK`` gets them again and the insert
  skips them, and since rollups only add the ids the insert returned, nothing doubles;
- with PostgreSQL away the batch is not acked and simply retried: events wait in Redis.
"""

import itertools
import logging
import math
import os
import socket
import time
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
import redis
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import FIELD, UsageRecord
from deployments.models import Adapter, CatalogModel, Deployment
from metering import rollups
from metering.choices import Endpoint, UsageStatus
from metering.models import DeadLetter, Price
from tenants.models import ApiKey, Tenant

log = logging.getLogger(__name__)

GROUP = "metering"
INT_MAX = 2**31 - 1
_INT_FIELDS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "latency_ms",
    "preemptions",
)
_OPTIONAL_INT_FIELDS = (
    "api_key_id",
    "deployment_id",
    "ttft_ms",
    "price_id",
    "adapter_id",
    "start_wait_ms",
    "replica_id",
)


def consumer_name() -> str:
    """One consumer per process: hostname-pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis | None = None) -> None:
    """Create the stream and the consumer group if missing (from the stream's beginning)."""
    client = client or get_redis()
    try:
        client.xgroup_create(usage_stream(), GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


Entry = tuple[bytes, dict[bytes, bytes] | None]


@dataclass
class BatchResult:
    """What one batch did."""

    read: int = 0
    inserted: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    dropped: int = 0  # only ever by the test hook (_dropped_on_purpose)
    ids: list[bytes] = field(default_factory=list, repr=False)


# --- Reading -----------------------------------------------------------------------------


def read_batch(
    consumer: str, count: int = 1000, block_ms: int = 1000, claim_idle_ms: int = 30_000
) -> list[Entry]:
    """The next entries to ingest: our own pending ones first (a failed batch is retried),
    then a dead consumer's entries idle longer than ``claim_idle_ms``, then new ones."""
    client, stream = get_redis(), usage_stream()
    own = client.xreadgroup(GROUP, consumer, {stream: "0"}, count=count)
    if own and own[0][1]:
        return own[0][1]
    claimed = client.xautoclaim(stream, GROUP, consumer, claim_idle_ms, "0-0", count=count)
    if claimed[1]:
        return claimed[1]
    new = client.xreadgroup(GROUP, consumer, {stream: ">"}, count=count, block=block_ms or None)
    return new[0][1] if new else []


# --- Decoding and pricing ------------------------------------------------------------------


class Malformed(ValueError):
    """An entry that can never be stored; it goes to the dead letters."""


def decode(fields: dict[bytes, bytes] | None) -> UsageRecord:
    if not fields or FIELD not in fields:
        raise Malformed("no 'e' field")
    try:
        record = UsageRecord.decode(fields[FIELD])
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise Malformed(f"undecodable: {exc}") from None
    _validate(record)
    return record


# Django's ``Choices.values`` builds a new list on every access: once per event, that was a
# tenth of the consumer's CPU.
_ENDPOINTS = frozenset(Endpoint.values)
_STATUSES = frozenset(UsageStatus.values)


def _validate(r: UsageRecord) -> None:
    if not isinstance(r.request_id, str) or not 0 < len(r.request_id) <= 64:
        raise Malformed("request_id must be a string of 1 to 64 characters")
    at = r.occurred_at
    if not isinstance(at, int | float) or isinstance(at, bool) or not math.isfinite(at):
        raise Malformed("occurred_at must be Unix seconds")
    if not 946684800 <= at <= 4102444800:  # 2000-01-01 .. 2100-01-01
        raise Malformed("occurred_at out of range")
    for name in (*_INT_FIELDS, "tenant_id", "model_id", "http_status"):
        _check_int(r, name, required=True)
    for name in _OPTIONAL_INT_FIELDS:
        _check_int(r, name, required=False)
    if r.http_status > 32767:
        raise Malformed("http_status out of range")
    if r.endpoint not in _ENDPOINTS:
        raise Malformed(f"unknown endpoint {r.endpoint!r}")
    if r.status not in _STATUSES:
        raise Malformed(f"unknown status {r.status!r}")
    if not isinstance(r.priority, str) or len(r.priority) > 2:
        raise Malformed("priority must be at most 2 characters")
    if r.cached_tokens > r.prompt_tokens:
        raise Malformed("cached_tokens exceeds prompt_tokens")
    if not isinstance(r.prompt_estimated, bool):
        raise Malformed("prompt_estimated must be true or false")


def _check_int(r: UsageRecord, name: str, required: bool) -> None:
    value = getattr(r, name)
    if value is None and not required:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT_MAX:
        raise Malformed(f"{name} must be an integer from 0 to {INT_MAX}")


@dataclass
class References:
    """The rows a batch refers to, loaded with one query per table."""

    tenant_currency: dict[int, str]
    models: set[int]
    key_tenant: dict[int, int]
    deployments: set[int]
    adapters: set[int]
    prices_by_id: dict[int, Price]
    versions: dict[tuple[int, str], list[Price]]  # base models' by (model, currency), oldest first
    adapter_versions: dict[tuple[int, str], list[Price]]  # adapters' own by (adapter, currency)

    @classmethod
    def load(cls, records: list[UsageRecord]) -> "References":
        tenants = dict(
            Tenant.objects.filter(pk__in={r.tenant_id for r in records}).values_list(
                "pk", "currency"
            )
        )
        model_ids = {r.model_id for r in records}
        adapter_ids = {r.adapter_id for r in records if r.adapter_id}
        versions: dict[tuple[int, str], list[Price]] = defaultdict(list)
        adapter_versions: dict[tuple[int, str], list[Price]] = defaultdict(list)
        prices = Price.objects.filter(
            Q(model_id__in=model_ids, adapter=None) | Q(adapter_id__in=adapter_ids)
        ).order_by("effective_from")
        by_id = {}
        for price in prices:
            if price.adapter_id is None:
                versions[(price.model_id, price.currency)].append(price)
            else:
                adapter_versions[(price.adapter_id, price.currency)].append(price)
            by_id[price.pk] = price
        return cls(
            tenant_currency=tenants,
            models=set(CatalogModel.objects.filter(pk__in=model_ids).values_list("pk", flat=True)),
            key_tenant=dict(
                ApiKey.objects.filter(
                    pk__in={r.api_key_id for r in records if r.api_key_id}
                ).values_list("pk", "tenant_id")
            ),
            deployments=set(
                Deployment.objects.filter(
                    pk__in={r.deployment_id for r in records if r.deployment_id}
                ).values_list("pk", flat=True)
            ),
            adapters=set(Adapter.objects.filter(pk__in=adapter_ids).values_list("pk", flat=True)),
            prices_by_id=by_id,
            versions=versions,
            adapter_versions=adapter_versions,
        )

    def check(self, r: UsageRecord) -> None:
        if r.tenant_id not in self.tenant_currency:
            raise Malformed(f"unknown tenant {r.tenant_id}")
        if r.model_id not in self.models:
            raise Malformed(f"unknown model {r.model_id}")
        if r.api_key_id is not None and self.key_tenant.get(r.api_key_id) != r.tenant_id:
            raise Malformed(f"key {r.api_key_id} is not a key of tenant {r.tenant_id}")

    def adapter_of(self, r: UsageRecord) -> int | None:
        """The record's adapter; one deleted while its usage waited in the stream (it had
        none stored yet) is billed as its base: usage that happened is never dropped."""
        return r.adapter_id if r.adapter_id in self.adapters else None

    def price_for(self, r: UsageRecord, at: datetime) -> Price | None:
        """The version the gateway saw if it is one that applies to the request, else the
        one in force: an adapter's own, or its base's while the adapter has none."""
        adapter_id = self.adapter_of(r)
        currency = self.tenant_currency[r.tenant_id]
        own = (
            _in_force(self.adapter_versions.get((adapter_id, currency)), at) if adapter_id else None
        )
        seen = self.prices_by_id.get(r.price_id) if r.price_id else None
        if seen is not None:
            if adapter_id is not None and seen.adapter_id == adapter_id:
                return seen
            # The base's price stands for an adapter only while the adapter has none of its
            # own in force: else the adapter would be billed at its base's.
            if seen.adapter_id is None and seen.model_id == r.model_id and own is None:
                return seen
        return own or _in_force(self.versions.get((r.model_id, currency)), at)


def _in_force(versions: list[Price] | None, at: datetime) -> Price | None:
    """The latest of the versions (oldest first) that started by ``at``."""
    if not versions:
        return None
    i = bisect_right([p.effective_from for p in versions], at)
    return versions[i - 1] if i else None


def event_cost(price: Price | None, r: UsageRecord) -> Decimal:
    """Decimal cost in the event's currency, rounded up to nine places (never under-bill).

    The gateway priced the request with the same function for its Redis money counter
    (``core.pricing.cost_nano``), so the sums agree to the nano-unit.
    """
    if price is None:
        return Decimal(0)
    return price.cost(r.prompt_tokens, r.cached_tokens, r.completion_tokens)


# --- Storing -----------------------------------------------------------------------------

_COLUMNS = [
    ("request_id", "text"),
    ("occurred_at", "timestamptz"),
    ("tenant_id", "bigint"),
    ("api_key_id", "bigint"),
    ("model_id", "bigint"),
    ("adapter_id", "bigint"),
    ("deployment_id", "bigint"),
    ("endpoint", "text"),
    ("priority", "text"),
    ("prompt_tokens", "integer"),
    ("cached_tokens", "integer"),
    ("completion_tokens", "integer"),
    ("reasoning_tokens", "integer"),
    ("prompt_estimated", "boolean"),
    ("status", "text"),
    ("http_status", "integer"),
    ("latency_ms", "integer"),
    ("ttft_ms", "integer"),
    ("start_wait_ms", "integer"),
    ("replica_id", "bigint"),
    ("preemptions", "integer"),
    ("price_id", "bigint"),
    ("currency", "text"),
    ("input_per_mtok", "numeric"),
    ("cached_input_per_mtok", "numeric"),
    ("output_per_mtok", "numeric"),
    ("cost", "numeric"),
    ("ingested_at", "timestamptz"),
    ("stream_ms", "bigint"),
    ("stream_seq", "bigint"),
    ("adjustment_hour", "timestamptz"),
]
INSERT_SQL = (
    f"INSERT INTO metering_usageevent ({', '.join(c for c, _ in _COLUMNS)}) "
    f"SELECT * FROM unnest({', '.join(f'%s::{t}[]' for _, t in _COLUMNS)}) "
    "ON CONFLICT (request_id) DO NOTHING RETURNING id"
)


def _row(
    stream_id: bytes,
    r: UsageRecord,
    refs: References,
    now: datetime,
    frozen_before: datetime | None,
) -> tuple[Any, ...]:
    at = datetime.fromtimestamp(r.occurred_at, UTC)
    price = refs.price_for(r, at)
    ms, _, seq = stream_id.decode().partition("-")
    adjustment_hour = None
    if frozen_before is not None and at < frozen_before:
        # Its period is closed: book it into the first open period, never the closed one.
        adjustment_hour = max(rollups.hour_of(now), frozen_before)
    return (
        r.request_id,
        at,
        r.tenant_id,
        r.api_key_id,
        r.model_id,
        refs.adapter_of(r),
        r.deployment_id if r.deployment_id in refs.deployments else None,
        r.endpoint,
        r.priority,
        r.prompt_tokens,
        r.cached_tokens,
        r.completion_tokens,
        r.reasoning_tokens,
        r.prompt_estimated,
        r.status,
        r.http_status,
        r.latency_ms,
        r.ttft_ms,
        r.start_wait_ms,
        r.replica_id,
        r.preemptions,
        price.pk if price else None,
        price.currency if price else refs.tenant_currency[r.tenant_id],
        price.input_per_mtok if price else Decimal(0),
        price.cached_input_per_mtok if price else Decimal(0),
        price.output_per_mtok if price else Decimal(0),
        event_cost(price, r),
        now,
        int(ms),
        int(seq or 0),
        adjustment_hour,
    )


def store(entries: list[Entry]) -> BatchResult:
    """Store a batch in one transaction (events, rollups, dead letters); does not ack."""
    result = BatchResult(read=len(entries), ids=[sid for sid, _ in entries])
    records: list[tuple[bytes, UsageRecord]] = []
    dead: list[DeadLetter] = []
    seen: set[str] = set()
    for stream_id, fields in entries:
        try:
            record = decode(fields)
        except Malformed as exc:
            dead.append(_dead(stream_id, fields, str(exc)))
            continue
        if record.request_id in seen:
            result.duplicates += 1
            continue
        seen.add(record.request_id)
        if _dropped_on_purpose(record):
            result.dropped += 1
            continue
        records.append((stream_id, record))
    with transaction.atomic():
        rollups.lock_shared()
        frozen_before = rollups.frozen_before()
        refs = References.load([r for _, r in records])
        now = timezone.now()
        rows = []
        for stream_id, record in records:
            try:
                refs.check(record)
            except Malformed as exc:
                dead.append(_dead(stream_id, {FIELD: record.encode()}, str(exc)))
                continue
            rows.append(_row(stream_id, record, refs, now, frozen_before))
        ids = _insert(rows)
        rollups.add_events(ids)
        DeadLetter.objects.bulk_create(dead, ignore_conflicts=True)
    result.inserted = len(ids)
    result.duplicates += len(rows) - len(ids)
    result.dead_letters = len(dead)
    return result


def _dropped_on_purpose(record: UsageRecord) -> bool:
    """The test hook behind the checks of the bill against the engines
    (tests/metering/test_engine_ledger.py, tests/vllm/test_engine_ledger.py): with
    ``TOLLGATE_TEST_DROP_USAGE_EVERY`` = N (ignored when TOLLGATE_ENV=production), every Nth
    event this process stores is acknowledged but never stored, as a broken consumer would
    lose it. The check must notice."""
    every = settings.TOLLGATE_TEST_DROP_USAGE_EVERY
    if not every or settings.PRODUCTION:
        return False
    return next(_SEEN_BY_HOOK) % every == every - 1


_SEEN_BY_HOOK = itertools.count()


def _insert(rows: list[tuple[Any, ...]]) -> list[int]:
    if not rows:
        return []
    columns = [list(column) for column in zip(*rows, strict=True)]
    with connection.cursor() as cursor:
        cursor.execute(INSERT_SQL, columns)
        return [row[0] for row in cursor.fetchall()]


def _dead(stream_id: bytes, fields: dict[bytes, bytes] | None, reason: str) -> DeadLetter:
    payload = (fields or {}).get(FIELD, b"") if isinstance(fields, dict) else b""
    return DeadLetter(
        stream_id=stream_id.decode(),
        payload=payload.decode("utf-8", "replace") if payload else repr(fields),
        reason=reason,
    )


def ack(ids: list[bytes]) -> None:
    if ids:
        get_redis().xack(usage_stream(), GROUP, *ids)


# --- Running -------------------------------------------------------------------------------

RETRYABLE = (OperationalError, InterfaceError)


def ingest_once(
    consumer: str,
    count: int = 1000,
    block_ms: int = 1000,
    claim_idle_ms: int = 30_000,
) -> BatchResult:
    """Read, store and then acknowledge one batch. Database errors leave it pending."""
    entries = read_batch(consumer, count, block_ms, claim_idle_ms)
    if not entries:
        return BatchResult()
    try:
        result = store(entries)
    except RETRYABLE:
        raise
    except DatabaseError:
        # One entry the checks missed must not block the stream: store them one by one.
        log.exception("batch of %d failed; storing entries one by one", len(entries))
        result = _store_singly(entries)
    ack(result.ids)
    return result


def _store_singly(entries: list[Entry]) -> BatchResult:
    total = BatchResult(read=len(entries), ids=[sid for sid, _ in entries])
    for stream_id, fields in entries:
        try:
            one = store([(stream_id, fields)])
        except RETRYABLE:
            raise
        except DatabaseError as exc:
            DeadLetter.objects.bulk_create(
                [_dead(stream_id, fields, f"database refused it: {exc}")], ignore_conflicts=True
            )
            total.dead_letters += 1
            continue
        total.inserted += one.inserted
        total.duplicates += one.duplicates
        total.dead_letters += one.dead_letters
    return total


def drain(consumer: str, seconds: float, count: int = 1000, claim_idle_ms: int = 30_000) -> int:
    """Ingest until the stream is empty or ``seconds`` have passed (the Celery task)."""
    ensure_group()
    deadline, stored = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        result = ingest_once(consumer, count, block_ms=0, claim_idle_ms=claim_idle_ms)
        stored += result.inserted
        if not result.read:
            break
    return stored


def trim_stream() -> int:
    """Drop stream entries every group has acknowledged; returns how many went."""
    client, stream = get_redis(), usage_stream()
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return 0
    if not groups:
        return 0
    floor = None
    for group in groups:
        mark = group["last-delivered-id"]
        if group["pending"]:
            mark = client.xpending(stream, group["name"])["min"]
        floor = mark if floor is None or _sid(mark) < _sid(floor) else floor
    return client.xtrim(stream, minid=floor, approximate=False)


def _sid(stream_id: bytes | str) -> tuple[int, int]:
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


# A batch's fixed cost is ~8 ms of the consumer's CPU and ~4.5 ms of PostgreSQL's (six
# queries, the transaction, four Redis calls); each event adds ~0.2 ms in all. At 165
# events/s (64 streams of 64 tokens) a 0.25-s wait made ~3.6 batches a second, half the
# consumer's CPU in fixed costs on the cores the gateway serves from.
LINGER_SECONDS = 1.0


def run_consumer(
    consumer: str,
    count: int = 1000,
    block_ms: int = 1000,
    claim_idle_ms: int = 30_000,
    stop: Any = None,
    trim_every: int = 100,
    linger: float = LINGER_SECONDS,
) -> None:
    """The long-running consumer loop (``manage.py consume_usage``).

    A batch costs about the same whatever its size (a transaction, the references, the
    rollup upserts, the Redis calls), and under a steady trickle every read returns the few
    events that arrived meanwhile. So after a batch smaller than ``count`` the consumer
    waits ``linger`` seconds for the next one to fill: on a busy appliance that is one batch
    of a few hundred events instead of dozens of tiny ones, at up to a second's delay in the
    console's figures (quota counters are the gateway's, in Redis, and reconciliation counts
    the stream's backlog: neither waits for ingestion).
    """
    backoff, batches, grouped = 0.5, 0, False
    log.info("usage consumer %s started on %s", consumer, usage_stream())
    while stop is None or not stop():
        try:
            if not grouped:  # once, and again after Redis failed (it may have lost it)
                ensure_group()
                grouped = True
            result = ingest_once(consumer, count, block_ms, claim_idle_ms)
            backoff = 0.5
            if result.read:
                log.info("%s", result)
                batches += 1
                if batches % trim_every == 0:
                    trim_stream()
                if result.read < count and linger > 0:
                    time.sleep(linger)
        except RETRYABLE:
            # PostgreSQL is away: the batch stays pending in Redis and is retried.
            log.warning("database unavailable; retrying in %.1fs", backoff, exc_info=True)
            _close_quietly()
            time.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        except redis.RedisError:
            grouped = False
            log.warning("redis unavailable; retrying in %.1fs", backoff, exc_info=True)
            time.sleep(backoff)
            backoff = min(backoff * 2, 10.0)


def _close_quietly() -> None:
    try:
        connection.close()
    except DatabaseError:
        pass  # the next query opens a fresh connection
