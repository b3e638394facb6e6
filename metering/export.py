"""Showback export: CSV lines streamed from rollups and adjustment lines, in constant memory.

``csv_lines(ExportQuery(...))`` yields the CSV text in chunks; the admin API and the
console both stream it with ``StreamingHttpResponse``. Rows come from PostgreSQL through a
server-side cursor (``.iterator(chunk_size=…)``), so memory does not grow with row count.
Two column sets: ``showback`` (Tollgate's own, documented in docs/admins/metering.md) and
``focus`` (the FinOps FOCUS 1.0 columns, one row per token kind).
"""

import csv
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import F, QuerySet, Sum
from django.db.models.functions import Trunc

from core.pricing import Rates, cost_nano, from_nano
from metering.models import UsageAdjustment, UsageRollup
from metering.rollups import month_start, next_month

GRANULARITIES = ("hour", "day", "month")
FORMATS = ("showback", "focus")
CHUNK_ROWS = 2000

SHOWBACK_COLUMNS = [
    "period_start",
    "period_end",
    "tenant",
    "key_name",
    "key_prefix",
    "model",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "input_per_mtok",
    "cached_input_per_mtok",
    "output_per_mtok",
    "cost",
    "currency",
    "line_type",
    "usage_period_start",
    "estimated_prompt_tokens",
    "adapter",  # appended (the documented promise): earlier columns keep their positions
]
FOCUS_COLUMNS = [
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodStart",
    "BillingPeriodEnd",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ConsumedQuantity",
    "ConsumedUnit",
    "PricingQuantity",
    "PricingUnit",
    "ListUnitPrice",
    "ListCost",
    "BilledCost",
    "EffectiveCost",
    "ProviderName",
    "PublisherName",
    "InvoiceIssuerName",
    "ServiceCategory",
    "ServiceName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
]
PROVIDER = "Tollgate"


@dataclass(frozen=True)
class ExportQuery:
    """What to export. ``tenant_ids`` None means every tenant (platform admins)."""

    start: datetime
    end: datetime
    granularity: str = "day"
    fmt: str = "showback"
    tenant_ids: frozenset[int] | None = None
    tenant: str = ""  # slug
    key: str = ""  # prefix
    model: str = ""  # served name (a base model: its adapters' usage included)
    adapter: str = ""  # served name


# --- Parsing request parameters ----------------------------------------------------------


def parse_query(params: Any, tenant_ids: frozenset[int] | None) -> ExportQuery:
    """An ExportQuery from request parameters; ValidationError with a message if invalid.

    ``period`` is a month (2026-11) or a day (2026-11-26); or ``start``/``end`` dates or
    ISO times (end exclusive). Without either: the current month.
    """
    granularity = params.get("granularity") or "day"
    if granularity not in GRANULARITIES:
        raise ValidationError({"granularity": f"Use one of {', '.join(GRANULARITIES)}."})
    fmt = params.get("format") or "showback"
    if fmt not in FORMATS:
        raise ValidationError({"format": f"Use one of {', '.join(FORMATS)}."})
    start, end = _range(params)
    return ExportQuery(
        start=start,
        end=end,
        granularity=granularity,
        fmt=fmt,
        tenant_ids=tenant_ids,
        tenant=params.get("tenant") or "",
        key=params.get("key") or "",
        model=params.get("model") or "",
        adapter=params.get("adapter") or "",
    )


def _range(params: Any) -> tuple[datetime, datetime]:
    period = params.get("period")
    if period:
        try:
            if len(period) == 7:
                start = datetime.strptime(period, "%Y-%m").replace(tzinfo=UTC)
                return start, next_month(start)
            start = datetime.strptime(period, "%Y-%m-%d").replace(tzinfo=UTC)
            return start, start + timedelta(days=1)
        except ValueError:
            raise ValidationError(
                {"period": "Use a month (2026-11) or a day (2026-11-26)."}
            ) from None
    if not params.get("start") and not params.get("end"):
        start = month_start(datetime.now(UTC))
        return start, next_month(start)
    start = parse_moment(params.get("start"), "start")
    end = parse_moment(params.get("end"), "end")
    if end <= start:
        raise ValidationError({"end": "The end must be after the start."})
    return start, end


def parse_moment(text: str | None, name: str) -> datetime:
    """A date (midnight UTC) or an ISO time; naive times are UTC."""
    if not text:
        raise ValidationError({name: "Give both start and end (or a period)."})
    try:
        if len(text) == 10:
            return datetime.combine(date.fromisoformat(text), datetime.min.time(), UTC)
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValidationError({name: f"{text!r} is not a date or ISO time."}) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


# --- Rows ----------------------------------------------------------------------------------


def filter_rows(qs: QuerySet, q: ExportQuery) -> QuerySet:
    """Rollup or adjustment rows inside the query's period, tenants, key, model and adapter."""
    qs = qs.filter(hour__gte=q.start, hour__lt=q.end)
    if q.tenant_ids is not None:
        qs = qs.filter(tenant_id__in=q.tenant_ids)
    if q.tenant:
        qs = qs.filter(tenant__slug=q.tenant)
    else:
        # Tollgate's own tenant (staff tests) is no customer's: shown only when named.
        qs = qs.exclude(tenant__internal=True)
    if q.key:
        qs = qs.filter(api_key__prefix=q.key)
    if q.model:
        qs = qs.filter(model__served_name=q.model)
    if q.adapter:
        qs = qs.filter(adapter__served_name=q.adapter)
    return qs


_GROUP = [
    "bucket",
    "usage_bucket",
    "tenant__slug",
    "tenant__name",
    "api_key__name",
    "api_key__prefix",
    "model__served_name",
    "adapter__served_name",
    "currency",
    "price__input_per_mtok",
    "price__cached_input_per_mtok",
    "price__output_per_mtok",
]
# A base model's line before its adapters' lines.
_ORDER = [F(f).asc(nulls_first=True) if f == "adapter__served_name" else f for f in _GROUP]
_SUMS = {
    name: Sum(name)
    for name in (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cost",
        "estimated_prompt_tokens",
    )
}


def _grouped(qs: QuerySet, q: ExportQuery, usage_hour: str) -> QuerySet:
    kind = q.granularity
    return (
        filter_rows(qs, q)
        .annotate(
            bucket=Trunc("hour", kind, tzinfo=UTC), usage_bucket=Trunc(usage_hour, kind, tzinfo=UTC)
        )
        .values(*_GROUP)
        .annotate(**_SUMS)
        .order_by(*_ORDER)
    )


def rows(q: ExportQuery) -> Iterator[dict[str, Any]]:
    """Usage lines, then adjustment lines; each a dict of the grouped fields and sums."""
    usage = _grouped(UsageRollup.objects.all(), q, "hour")
    adjustments = _grouped(UsageAdjustment.objects.all(), q, "usage_hour")
    for line_type, qs in (("usage", usage), ("adjustment", adjustments)):
        for row in qs.iterator(chunk_size=CHUNK_ROWS):
            row["line_type"] = line_type
            yield row


def totals(q: ExportQuery) -> dict[str, Any]:
    """Sums over everything the query exports (for checks and the console's footer)."""
    out = {name: 0 for name in _SUMS}
    out["cost"] = Decimal(0)
    for qs in (UsageRollup.objects.all(), UsageAdjustment.objects.all()):
        sums = filter_rows(qs, q).aggregate(**_SUMS)
        for name in _SUMS:
            out[name] += sums[name] or 0
    return out


def _bucket_end(start: datetime, granularity: str) -> datetime:
    if granularity == "hour":
        return start + timedelta(hours=1)
    if granularity == "day":
        return start + timedelta(days=1)
    return next_month(start)


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Decimal | None) -> str:
    return "" if value is None else format(value, "f")


# --- Column sets -----------------------------------------------------------------------


def showback_record(row: dict[str, Any], q: ExportQuery) -> list[Any]:
    start = max(row["bucket"], q.start)
    end = min(_bucket_end(row["bucket"], q.granularity), q.end)
    return [
        _iso(start),
        _iso(end),
        row["tenant__slug"],
        row["api_key__name"] or "",
        row["api_key__prefix"] or "",
        row["model__served_name"],
        row["requests"],
        row["prompt_tokens"],
        row["cached_tokens"],
        row["completion_tokens"],
        _plain(row["price__input_per_mtok"]),
        _plain(row["price__cached_input_per_mtok"]),
        _plain(row["price__output_per_mtok"]),
        _plain(row["cost"]),
        row["currency"],
        row["line_type"],
        _iso(row["usage_bucket"]),
        row["estimated_prompt_tokens"],
        row["adapter__served_name"] or "",
    ]


MILLION = Decimal(1_000_000)


def _part_costs(row: dict[str, Any], parts: list[tuple[str, int, Decimal | None]]) -> list[Decimal]:
    """Each token kind's share of a line, rounded half to even to the nano-unit."""
    rates = Rates.of(
        row["price__input_per_mtok"],
        row["price__cached_input_per_mtok"],
        row["price__output_per_mtok"],
    )
    costs = []
    for kind, qty, _ in parts:
        # (prompt, cached, completion) tokens that cost exactly this kind's tokens
        tokens = {"input": (qty, 0, 0), "cached-input": (qty, qty, 0), "output": (0, 0, qty)}[kind]
        costs.append(from_nano(cost_nano(rates, *tokens, half_even=True)))
    return costs


def _resource(row: dict[str, Any]) -> tuple[str, str, str]:
    """The FOCUS resource a line's tokens were used on (id, type, description): the model, or
    the LoRA adapter called on it. An adapter is its own resource and SKU, whatever it is
    priced at (its own price, or its base's while it has none)."""
    model, adapter = row["model__served_name"], row["adapter__served_name"]
    if adapter:
        return adapter, "LoRA adapter", f"{adapter} (adapter on {model})"
    return model, "Model", model


def focus_records(row: dict[str, Any], q: ExportQuery) -> list[list[Any]]:
    """One FOCUS row per token kind used; their BilledCost adds up to the line's cost."""
    parts = [
        ("input", row["prompt_tokens"] - row["cached_tokens"], row["price__input_per_mtok"]),
        ("cached-input", row["cached_tokens"], row["price__cached_input_per_mtok"]),
        ("output", row["completion_tokens"], row["price__output_per_mtok"]),
    ]
    parts = [p for p in parts if p[1]]
    costs = _part_costs(row, parts)
    if costs:
        # Events are priced one by one and rounded up; put the rounding difference on the
        # last row so the FOCUS total equals the showback total to the nano-unit.
        costs[-1] += row["cost"] - sum(costs)
    billing_start = month_start(row["bucket"])
    charge_start = row["usage_bucket"] if row["line_type"] == "adjustment" else row["bucket"]
    charge_end = _bucket_end(charge_start, q.granularity)
    if row["line_type"] == "usage":
        charge_start, charge_end = max(charge_start, q.start), min(charge_end, q.end)
    key = row["api_key__prefix"] or ""
    resource, resource_type, described = _resource(row)
    out = []
    for (kind, qty, price), cost in zip(parts, costs, strict=True):
        out.append(
            [
                row["tenant__slug"],
                row["tenant__name"],
                row["currency"],
                _iso(billing_start),
                _iso(next_month(billing_start)),
                "Usage",
                "Correction" if row["line_type"] == "adjustment" else "",
                f"{described} {kind} tokens",
                _iso(charge_start),
                _iso(charge_end),
                qty,
                "Tokens",
                _plain(Decimal(qty) / MILLION),
                "1M Tokens",
                _plain(price or Decimal(0)),
                _plain(cost),
                _plain(cost),
                _plain(cost),
                PROVIDER,
                PROVIDER,
                PROVIDER,
                "AI and Machine Learning",
                "LLM inference",
                resource,
                resource,
                resource_type,
                f"{resource}:{kind}",
                f"{resource}:{kind}:{_plain(price or Decimal(0))}",
                key,
                row["api_key__name"] or "",
            ]
        )
    return out


def records(q: ExportQuery) -> Iterator[list[Any]]:
    """The header, then every CSV record of the chosen column set."""
    if q.fmt == "focus":
        yield FOCUS_COLUMNS
        for row in rows(q):
            yield from focus_records(row, q)
    else:
        yield SHOWBACK_COLUMNS
        for row in rows(q):
            yield showback_record(row, q)


def csv_lines(q: ExportQuery) -> Iterator[str]:
    """The CSV text in chunks of about CHUNK_ROWS records."""
    return _chunked(records(q))


def _chunked(source: Iterable[list[Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    n = 0
    for record in source:
        writer.writerow(record)
        n += 1
        if n % CHUNK_ROWS == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    if buffer.tell():
        yield buffer.getvalue()


def filename(q: ExportQuery) -> str:
    scope = q.tenant or "all"
    return f"tollgate-{q.fmt}-{scope}-{q.start:%Y%m%d}-{q.end:%Y%m%d}-{q.granularity}.csv"
