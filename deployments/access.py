"""Which catalogue models a tenant, an API key and a console user may see and call.

A tenant may call the public models and the private ones granted to it; a tenant whose
``model_access`` is "listed" only those of them it lists, and a key with a list of its own
only those of its tenant's. A user sees what any of their tenants may call (platform admins:
every model). The gateway's snapshot, the admin API, the console and metering all ask here;
the tenants app asks through ``tenants.access.catalogue()`` (this module, handed over at
start by ``DeploymentsConfig.ready``), as it sits a layer below the catalogue.
"""

from typing import Any

from django.db.models import Q, QuerySet

from deployments.choices import Visibility
from deployments.models import Adapter, CatalogModel
from tenants.access import member_tenant_ids
from tenants.choices import ModelAccess
from tenants.models import ApiKey, Tenant


def models_for_tenant(tenant: Tenant) -> QuerySet[CatalogModel]:
    """The catalogue models a tenant may call."""
    visible = CatalogModel.objects.filter(
        Q(visibility=Visibility.PUBLIC) | Q(grants__tenant=tenant)
    )
    if tenant.model_access == ModelAccess.LISTED:
        visible = visible.filter(pk__in=tenant.allowed_models.values("pk"))
    return visible.distinct()


def adapters_for_tenant(tenant: Tenant) -> QuerySet[Adapter]:
    """The adapters a tenant may call: its own, those granted to it and the public ones, each
    on a base model the tenant may call."""
    mine = Q(tenant=tenant) | Q(visibility=Visibility.PUBLIC) | Q(grants__tenant=tenant)
    bases = models_for_tenant(tenant).values("pk")
    return Adapter.objects.filter(mine, base__in=bases).distinct()


def adapters_visible_to(user: Any) -> QuerySet[Adapter]:
    """Every adapter for platform admins; for others, what any of their tenants may call."""
    if user.is_staff:
        return Adapter.objects.all()
    ids: set[int] = set()
    for tenant in Tenant.objects.filter(pk__in=member_tenant_ids(user)):
        ids |= set(adapters_for_tenant(tenant).values_list("pk", flat=True))
    return Adapter.objects.filter(pk__in=ids)


def models_visible_to(user: Any) -> QuerySet[CatalogModel]:
    """Every model for platform admins; for others, what any of their tenants may call."""
    if user.is_staff:
        return CatalogModel.objects.all()
    ids: set[int] = set()
    for tenant in Tenant.objects.filter(pk__in=member_tenant_ids(user)):
        ids |= set(models_for_tenant(tenant).values_list("pk", flat=True))
    return CatalogModel.objects.filter(pk__in=ids)


def models_for_key(key: ApiKey) -> QuerySet[CatalogModel]:
    """The models one API key may call: its tenant's, narrowed by the key's own list."""
    allowed = models_for_tenant(key.tenant)
    if key.allowed_models.exists():
        allowed = allowed.filter(pk__in=key.allowed_models.values("pk"))
    return allowed
