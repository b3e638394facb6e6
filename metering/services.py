"""Rules for prices (versioned, never edited, looked up by the time of a request), who sees
which prices and usage, and which usage an export query covers."""

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from core.changes import publish_change
from core.errors import Conflict
from deployments.access import models_visible_to
from deployments.models import CatalogModel
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
) -> Price:
    """A new price version for a model; the previous version stays for history."""
    now = timezone.now()
    effective_from = effective_from or now
    if effective_from < now - BACKDATE_GRACE:
        raise ValidationError(
            {"effective_from": "Prices cannot be backdated: billed requests keep their price."}
        )
    price = Price(
        model=model,
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
        raise Conflict(
            {"effective_from": "A price for this model starts at that moment already."}
        ) from None
    record(actor, AuditAction.CREATE, price, changes=snapshot(price, PRICE_FIELDS))
    publish_change("price", model.pk)
    return price


def price_at(model: CatalogModel, currency: str, when: datetime) -> Price | None:
    """The price version in force for a model and currency at a moment."""
    return (
        Price.objects.filter(model=model, currency=currency, effective_from__lte=when)
        .order_by("-effective_from")
        .first()
    )


def filter_usage(q: export.ExportQuery) -> QuerySet[UsageRollup]:
    """The hourly usage rollups an export query covers: what the console charts for a
    query is what the showback CSV of the same query bills."""
    return export.filter_rows(UsageRollup.objects.all(), q)


# --- Who sees what (the rules: tenants.access, deployments.access) ----------------------------


def prices_visible_to(user: Any) -> QuerySet[Price]:
    """The prices of the models the user may see."""
    return Price.objects.select_related("model").filter(model__in=models_visible_to(user))


def usage_events_visible_to(user: Any) -> QuerySet[UsageEvent]:
    """Requests' usage: tenant admins see their tenants', members their own keys'."""
    events = UsageEvent.objects.select_related("tenant", "api_key", "model", "deployment")
    return own_rows(user, events, owner="api_key__created_by")


def usage_rollups_visible_to(user: Any) -> QuerySet[UsageRollup]:
    """Hourly usage, seen as the requests it sums are."""
    return own_rows(user, UsageRollup.objects.all(), owner="api_key__created_by")
