"""Quota reconciliation: the gateway's Redis counters recomputed from PostgreSQL.

The gateway settles a request in one Lua call that adds to ``tokens_used``/``money_used``
AND appends the usage event to the stream (gateway/settle.lua). So at any instant, the
counters hold exactly the events in the stream up to its last id. Reconciliation uses
that to stay precise while traffic flows, without waiting for an empty stream:

1. In one Lua call (atomic in Redis): read the counters ``R``, the stream's last id ``L``,
   and the entries not yet acknowledged by the metering group up to ``L`` (pending plus
   not yet delivered) — the backlog ``B``.
2. In one REPEATABLE READ snapshot of PostgreSQL: ``P`` = the period's rollups and
   adjustment lines minus events stored from stream ids after ``L``; plus the events of
   ``B`` not stored yet (priced as ingestion will price them).
3. ``drift = R - expected``; the correction is applied with HINCRBY (not SET), so requests
   settled meanwhile are kept.

A backlog larger than ``BACKLOG_CAP`` entries (e.g. PostgreSQL was down for a while) is
"skipped: backlog" and retried on the next run. Reservation counters left negative are
reset to 0.
"""

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import Q, Sum
from django.utils import timezone
from prometheus_client import Gauge

from core.keyspace import QUOTA_TTL_SECONDS, quota_key, usage_stream
from core.pricing import from_nano, to_nano
from core.redis import get_redis
from core.usage import UsageRecord
from metering import ingest
from metering.models import QuotaReconciliation, UsageAdjustment, UsageEvent, UsageRollup
from metering.periods import period_end, period_id, period_start
from tenants.models import Tenant

log = logging.getLogger(__name__)

BACKLOG_CAP = 50_000
ROLLOVER_WINDOW = timedelta(hours=2)

DRIFT_TOKENS = Gauge(
    "tollgate_quota_drift_tokens",
    "Redis tokens_used minus PostgreSQL at the last check",
    ["tenant"],
)
DRIFT_MONEY = Gauge(
    "tollgate_quota_drift_money",
    "Redis money_used minus PostgreSQL at the last check",
    ["tenant"],
)

SNAPSHOT_LUA = """
local q = redis.call('HMGET', KEYS[1], 'tokens_used', 'money_used')
if redis.call('EXISTS', KEYS[2]) == 0 then return {q, '0-0', 1, {}} end
local function field(flat, name)
  for i = 1, #flat, 2 do if flat[i] == name then return flat[i + 1] end end
end
local last = field(redis.call('XINFO', 'STREAM', KEYS[2]), 'last-generated-id')
local delivered = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
  if field(g, 'name') == ARGV[1] then delivered = field(g, 'last-delivered-id') end
end
local cap = tonumber(ARGV[2])
local out = {}
if delivered then
  local pending = redis.call('XPENDING', KEYS[2], ARGV[1], '-', last, cap + 1)
  if #pending > cap then return {q, last, 0, {}} end
  for _, p in ipairs(pending) do
    local e = redis.call('XRANGE', KEYS[2], p[1], p[1])
    if #e > 0 then table.insert(out, field(e[1][2], 'e') or '') end
  end
end
local from = delivered and ('(' .. delivered) or '-'
local newer = redis.call('XRANGE', KEYS[2], from, last, 'COUNT', cap + 1)
if #out + #newer > cap then return {q, last, 0, {}} end
for _, e in ipairs(newer) do table.insert(out, field(e[2], 'e') or '') end
return {q, last, 1, out}
"""

APPLY_LUA = """
if tonumber(ARGV[1]) ~= 0 then redis.call('HINCRBY', KEYS[1], 'tokens_used', ARGV[1]) end
if tonumber(ARGV[2]) ~= 0 then redis.call('HINCRBY', KEYS[1], 'money_used', ARGV[2]) end
for _, f in ipairs({'tokens_reserved', 'money_reserved'}) do
  local v = tonumber(redis.call('HGET', KEYS[1], f) or '0')
  if v < 0 then redis.call('HSET', KEYS[1], f, 0) end
end
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return 1
"""


@dataclass(frozen=True)
class Snapshot:
    tokens: int
    money_nano: int
    last_ms: int
    last_seq: int
    backlog: list[bytes] | None  # None: larger than the cap


def snapshot(key: str) -> Snapshot:
    (tokens, money), last, complete, raw = get_redis().eval(
        SNAPSHOT_LUA, 2, key, usage_stream(), ingest.GROUP, BACKLOG_CAP
    )
    ms, _, seq = last.decode().partition("-")
    return Snapshot(
        tokens=int(tokens or 0),
        money_nano=int(money or 0),
        last_ms=int(ms),
        last_seq=int(seq or 0),
        backlog=list(raw) if complete else None,
    )


def _stored_figures(
    tenant: Tenant, start: datetime, end: datetime, snap: Snapshot
) -> tuple[int, Decimal]:
    """Tokens and money of the tenant's period as stored, up to the snapshot's stream id."""
    sums = {"t": Sum("prompt_tokens") + Sum("completion_tokens"), "m": Sum("cost")}
    tokens, money = 0, Decimal(0)
    after = Q(stream_ms__gt=snap.last_ms) | Q(stream_ms=snap.last_ms, stream_seq__gt=snap.last_seq)
    for qs, sign in (
        (UsageRollup.objects.filter(tenant=tenant, hour__gte=start, hour__lt=end), 1),
        (
            UsageAdjustment.objects.filter(
                tenant=tenant, usage_hour__gte=start, usage_hour__lt=end
            ),
            1,
        ),
        (
            UsageEvent.objects.filter(
                after, tenant=tenant, occurred_at__gte=start, occurred_at__lt=end
            ),
            -1,
        ),
    ):
        row = qs.aggregate(**sums)
        tokens += sign * (row["t"] or 0)
        money += sign * (row["m"] or Decimal(0))
    return tokens, money


def _backlog_figures(
    tenant: Tenant, start: datetime, end: datetime, raw: Iterable[bytes]
) -> tuple[int, Decimal, int]:
    """Tokens and money of backlog events of this tenant and period not stored yet."""
    mine = []
    for payload in raw:
        try:
            record = ingest.decode({b"e": payload})
        except ingest.Malformed:
            continue  # it will be a dead letter, never billed
        at = datetime.fromtimestamp(record.occurred_at, UTC)
        if record.tenant_id == tenant.pk and start <= at < end:
            mine.append(record)
    if not mine:
        return 0, Decimal(0), 0
    stored = set(
        UsageEvent.objects.filter(request_id__in=[r.request_id for r in mine]).values_list(
            "request_id", flat=True
        )
    )
    fresh: dict[str, UsageRecord] = {r.request_id: r for r in mine if r.request_id not in stored}
    refs = ingest.References.load(list(fresh.values()))
    tokens, money = 0, Decimal(0)
    for r in fresh.values():
        at = datetime.fromtimestamp(r.occurred_at, UTC)
        tokens += r.prompt_tokens + r.completion_tokens
        if r.tenant_id in refs.tenant_currency and r.model_id in refs.models:
            money += ingest.event_cost(refs.price_for(r, at), r)
    return tokens, money, len(fresh)


def reconcile_tenant(tenant: Tenant, at: datetime) -> QuotaReconciliation:
    """Reconcile one tenant's counters for the period containing ``at``; record the result."""
    period = tenant.quota_period
    key = quota_key(tenant.pk, period_id(period, at))
    start, end = period_start(period, at), period_end(period, at)
    snap = snapshot(key)
    result = QuotaReconciliation(
        tenant=tenant,
        period_id=period_id(period, at),
        checked_at=timezone.now(),
        tokens_redis=snap.tokens,
        money_redis=from_nano(snap.money_nano),
    )
    if snap.backlog is None:
        result.status = QuotaReconciliation.Status.SKIPPED_BACKLOG
        result.backlog_events = BACKLOG_CAP
        log.info("quota reconcile of %s skipped: backlog over %d", tenant.slug, BACKLOG_CAP)
        return _save(result)
    with _repeatable_read():
        tokens, money = _stored_figures(tenant, start, end, snap)
        extra_tokens, extra_money, result.backlog_events = _backlog_figures(
            tenant, start, end, snap.backlog
        )
    result.tokens_db, result.money_db = tokens + extra_tokens, money + extra_money
    delta_tokens = result.tokens_db - snap.tokens
    delta_money = to_nano(result.money_db) - snap.money_nano
    get_redis().eval(APPLY_LUA, 1, key, delta_tokens, delta_money, QUOTA_TTL_SECONDS)
    drifted = delta_tokens or delta_money
    result.status = (
        QuotaReconciliation.Status.CORRECTED if drifted else QuotaReconciliation.Status.OK
    )
    if drifted:
        log.warning(
            "quota drift for %s %s: tokens %+d, money %+s (corrected)",
            tenant.slug,
            result.period_id,
            -delta_tokens,
            from_nano(-delta_money),
        )
    DRIFT_TOKENS.labels(tenant.slug).set(-delta_tokens)
    DRIFT_MONEY.labels(tenant.slug).set(float(from_nano(-delta_money)))  # gauge only, not billing
    return _save(result)


class _repeatable_read:
    """One consistent PostgreSQL snapshot (plain atomic inside an outer transaction)."""

    def __enter__(self) -> None:
        self.atomic = transaction.atomic()
        outer = connection.in_atomic_block
        self.atomic.__enter__()
        if not outer:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")

    def __exit__(self, *exc: object) -> None:
        self.atomic.__exit__(*exc)


def _save(result: QuotaReconciliation) -> QuotaReconciliation:
    fields = {
        f: getattr(result, f)
        for f in (
            "checked_at",
            "status",
            "tokens_redis",
            "tokens_db",
            "money_redis",
            "money_db",
            "backlog_events",
        )
    }
    row, _ = QuotaReconciliation.objects.update_or_create(
        tenant=result.tenant, period_id=result.period_id, defaults=fields
    )
    return row


def reconcile_all(now: datetime | None = None) -> list[QuotaReconciliation]:
    """Reconcile every tenant with a quota; just after a roll-over also the period that
    ended, so its final figures settle and the new one starts from PostgreSQL's numbers."""
    now = now or timezone.now()
    results = []
    tenants = Tenant.objects.filter(Q(quota_tokens__isnull=False) | Q(quota_amount__isnull=False))
    for tenant in tenants:
        start = period_start(tenant.quota_period, now)
        if now - start < ROLLOVER_WINDOW:
            results.append(reconcile_tenant(tenant, start - timedelta(microseconds=1)))
        results.append(reconcile_tenant(tenant, now))
    return results
