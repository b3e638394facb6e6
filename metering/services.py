"""Rules for prices (versioned, never edited, looked up by the time of a request), who sees
which prices and usage, and which usage an export query covers.

A LoRA adapter may have prices of its own (rows with ``adapter`` set, ``model`` its base);
while it has none in force, its requests are billed at its base's price."""

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from core.changes import publish_change
from core.errors import Conflict
from deployments.access import adapters_visible_to, models_visible_to
from deployments.models import Adapter, CatalogModel
from metering import export
from metering.models import PRICE_FIELDS, Price, UsageEvent, UsageRollup
from tenants.access import own_rows
from tenants.audit import Actor, record, snapshot
from tenants.choices import AuditAction

# A price may start slightly in the past (clock skew between the admin and the box),
# never far enough back to re-price requests that were already billed.
BACKDATE_GRACE = timedelta(minutes=5)


def set_price(
    actor: Actor,
    model: CatalogModel,
    input_per_mtok: Decimal,
    cached_input_per_mtok: Decimal | None,
    output_per_mtok: Decimal,
    currency: str = "USD",
    effective_from: datetime | None = None,
    adapter: Adapter | None = None,
) -> Price:
    """A new price version for a model, or for one of its adapters (``model`` is then the
    adapter's base); the previous version stays for history."""
    if adapter is not None and adapter.base_id != model.pk:
        raise ValidationError(
            {"adapter": f"{adapter} is an adapter of {adapter.base}, not {model}."}
        )
    now = timezone.now()
    effective_from = effective_from or now
    if effective_from < now - BACKDATE_GRACE:
        raise ValidationError(
            {"effective_from": "Prices cannot be backdated: billed requests keep their price."}
        )
    price = Price(
        model=model,
        adapter=adapter,
        currency=currency,
        input_per_mtok=input_per_mtok,
        cached_input_per_mtok=input_per_mtok
        if cached_input_per_mtok is None
        else cached_input_per_mtok,
        output_per_mtok=output_per_mtok,
        effective_from=effective_from,
        created_by=actor if actor is not None and actor.is_authenticated else None,
    )
    price.full_clean(validate_constraints=False)
    try:
        with transaction.atomic():
            price.save()
    except IntegrityError:
        what = "adapter" if adapter is not None else "model"
        raise Conflict(
            {"effective_from": f"A price for this {what} starts at that moment already."}
        ) from None
    # An adapter's owner sees its price change in their tenant's audit log.
    owner = adapter.tenant if adapter is not None else None
    record(actor, AuditAction.CREATE, price, tenant=owner, changes=snapshot(price, PRICE_FIELDS))
    publish_change("price", model.pk)
    return price


def set_adapter_price(
    actor: Actor,
    adapter: Adapter,
    input_per_mtok: Decimal,
    cached_input_per_mtok: Decimal | None,
    output_per_mtok: Decimal,
    currency: str = "USD",
    effective_from: datetime | None = None,
) -> Price:
    """A new price version for an adapter; until its first starts, its base's price applies."""
    return set_price(
        actor,
        adapter.base,
        input_per_mtok,
        cached_input_per_mtok,
        output_per_mtok,
        currency=currency,
        effective_from=effective_from,
        adapter=adapter,
    )


def price_at(
    model: CatalogModel, currency: str, when: datetime, adapter: Adapter | None = None
) -> Price | None:
    """The price version in force at a moment for a model, or for an adapter of it: the
    adapter's own if it has one in force then, else its base's."""
    if adapter is not None:
        own = _in_force(Price.objects.filter(adapter=adapter), currency, when)
        if own is not None:
            return own
    return _in_force(Price.objects.filter(model=model, adapter=None), currency, when)


def _in_force(prices: QuerySet[Price], currency: str, when: datetime) -> Price | None:
    return (
        prices.filter(currency=currency, effective_from__lte=when)
        .order_by("-effective_from")
        .first()
    )


def filter_usage(q: export.ExportQuery) -> QuerySet[UsageRollup]:
    """The hourly usage rollups an export query covers: what the console charts for a
    query is what the showback CSV of the same query bills."""
    return export.filter_rows(UsageRollup.objects.all(), q)


# --- Who sees what (the rules: tenants.access, deployments.access) ----------------------------


def prices_visible_to(user: Any) -> QuerySet[Price]:
    """The prices of the models and adapters the user may see (another tenant's private
    adapter and its prices do not exist for them)."""
    base = Q(adapter=None, model__in=models_visible_to(user))
    return Price.objects.select_related("model", "adapter").filter(
        base | Q(adapter__in=adapters_visible_to(user))
    )


def usage_events_visible_to(user: Any) -> QuerySet[UsageEvent]:
    """Requests' usage: tenant admins see their tenants', members their own keys'."""
    events = UsageEvent.objects.select_related(
        "tenant", "api_key", "model", "adapter", "deployment"
    )
    return own_rows(user, events, owner="api_key__created_by")


def usage_rollups_visible_to(user: Any) -> QuerySet[UsageRollup]:
    """Hourly usage, seen as the requests it sums are."""
    return own_rows(user, UsageRollup.objects.all(), owner="api_key__created_by")
