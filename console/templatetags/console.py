"""Formatting with units: every number the console shows says what it counts."""

from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince

register = template.Library()


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@register.filter
def gb(value: Any) -> str:
    """Bytes as GB (10^9), the unit the memory-fit arithmetic uses."""
    n = _num(value)
    return "—" if n is None else f"{n / 1e9:,.1f} GB"


@register.filter
def size(value: Any) -> str:
    """Bytes in the unit that suits them (a LoRA adapter's files: kB to GB, powers of 10)."""
    n = _num(value)
    if n is None:
        return "—"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n):,} bytes"


@register.filter
def tokens(value: Any) -> str:
    n = _num(value)
    if n is None:
        return "—"
    return f"{int(n):,} token" + ("" if int(n) == 1 else "s")


@register.filter
def count(value: Any, unit: str) -> str:
    """``{{ n|count:"request" }}`` → "1,234 requests"."""
    n = _num(value)
    if n is None:
        return "—"
    return f"{int(n):,} {unit}" + ("" if int(n) == 1 else "s")


@register.filter
def limit(value: Any, unit: str) -> str:
    """A per-minute or concurrency limit; None means unlimited."""
    n = _num(value)
    return "unlimited" if n is None else f"{int(n):,} {unit}"


# The one rule for money on every page, table and chart axis (charts.js's tollgateMoney
# follows it): thousands separators, at least two decimals and as many more as the amount
# has (a price's own precision, up to the nine places costs are stored with), never an
# exponent. 0.25 → "0.25", 1 → "1.00", 0.00009 → "0.00009", 12345.5 → "12,345.50".
MONEY_MAX_PLACES = 9


def money_text(value: Any) -> str | None:
    try:
        amount = Decimal(str(value))
    except (InvalidOperation, TypeError, ValueError):
        return None
    if not amount.is_finite():
        return None
    exponent = amount.normalize().as_tuple().exponent
    places = min(MONEY_MAX_PLACES, max(2, -exponent if isinstance(exponent, int) else 2))
    return f"{amount:,.{places}f}"


@register.filter
def money(value: Any, currency: str = "") -> str:
    """A money amount with its currency, by the one rule above."""
    text = money_text(value)
    if text is None:
        return "—"
    return f"{text} {currency}".strip()


@register.filter
def per_mtok(value: Any, currency: str = "") -> str:
    if value is None:
        return "—"
    return f"{money(value, currency)} / 1M tokens"


@register.filter
def pct(value: Any, places: int = 0) -> str:
    """A 0…1 share as a percentage."""
    n = _num(value)
    return "—" if n is None else f"{n * 100:.{places}f} %"


@register.filter
def ms(value: Any) -> str:
    n = _num(value)
    if n is None:
        return "—"
    return f"{n / 1000:.2f} s" if n >= 10000 else f"{n:,.0f} ms"


@register.filter
def seconds(value: Any) -> str:
    n = _num(value)
    if n is None:
        return "—"
    return f"{n:.1f} s" if n < 120 else f"{n / 60:.1f} min"


@register.filter
def rate(value: Any, unit: str) -> str:
    n = _num(value)
    return "—" if n is None else f"{n:,.1f} {unit}/s"


@register.filter
def ago(value: datetime | None) -> str:
    if not value:
        return "never"
    now = timezone.now()
    if abs((now - value).total_seconds()) < 60:
        return "just now"
    if value > now:
        return f"in {timesince(now, value)}"
    return f"{timesince(value)} ago"


@register.simple_tag
def badge(state: Any, label: Any = None) -> str:
    """A coloured state label; the colour follows the state's meaning."""
    good = {"ready", "active", "online", "succeeded", "ok", "running", "holds"}
    bad = {"failed", "crashed", "revoked", "suspended", "unreachable", "error", "expired", "drift"}
    warn = {
        "degraded",
        "deploying",
        "pulling",
        "starting",
        "loading",
        "warming",
        "draining",
        "stopping",
        "queued",
        "pending",
        "disabled",
        "client_closed",
        "checking",
        "no_counters",
    }
    kind = "good" if state in good else "bad" if state in bad else "warn" if state in warn else ""
    return format_html('<span class="badge {}">{}</span>', kind, label or state)


@register.simple_tag
def bar(value: Any, total: Any = 100, label: str = "") -> str:
    """A horizontal progress bar for a value out of total."""
    v, t = _num(value) or 0.0, _num(total) or 0.0
    share = max(0.0, min(100.0, 100.0 * v / t)) if t else 0.0
    return format_html(
        '<span class="bar" role="progressbar" aria-valuenow="{}" aria-valuemin="0" '
        'aria-valuemax="100" title="{}"><span style="width:{}%"></span></span>',
        f"{share:.0f}",
        label or f"{share:.0f} %",
        f"{share:.1f}",
    )


@register.simple_tag(takes_context=True)
def sort_link(context: dict, column: Any) -> str:
    """A column header that sorts by it, toggling the direction."""
    if not column.sort:
        return column.label
    current, base = context.get("sort", ""), context.get("sort_query", "")
    descending = current == column.sort
    target = f"-{column.sort}" if descending else column.sort
    arrow = " ▲" if current == column.sort else " ▼" if current == f"-{column.sort}" else ""
    query = f"{base}&sort={target}" if base else f"sort={target}"
    return format_html('<a href="?{}">{}{}</a>', query, column.label, arrow)
