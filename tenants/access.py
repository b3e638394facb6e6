"""Who sees what: the visibility rules the admin API, the console and metering all follow.

Tenant isolation is absolute: what belongs to a tenant the user is not a member of is left
out of every queryset here, so asking for it answers 404, exactly like something that does
not exist. Inside the user's own tenants:

- platform admins (staff users) see everything, in every tenant;
- tenant admins see all of their tenants' rows, and their audit log and usage reports;
- tenant members see their tenants and, of the rows made per person (API keys and the usage
  of those keys), only their own.

Whether a user may also *change* what they see is a second question, answered with 403:
``tenants.permissions`` for the admin API, ``console.access`` for the console's pages.
"""

from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured
from django.db.models import Q, QuerySet

from tenants.choices import Role
from tenants.models import AdminToken, ApiKey, AuditLog, Membership, Tenant

# --- Tenants and roles -------------------------------------------------------------------


def member_tenant_ids(user: Any) -> set[int]:
    """Ids of every tenant a (non-staff) user belongs to."""
    return set(user.memberships.values_list("tenant_id", flat=True))


def admin_tenant_ids(user: Any) -> set[int]:
    """Ids of the tenants a (non-staff) user administers."""
    return set(user.memberships.filter(role=Role.ADMIN).values_list("tenant_id", flat=True))


def is_tenant_admin(user: Any, tenant_id: int) -> bool:
    """Platform admins act as tenant admins everywhere."""
    return user.is_staff or tenant_id in admin_tenant_ids(user)


def role_in(user: Any, tenant: Tenant) -> str | None:
    """The user's role in the tenant (platform admins act as tenant admins), or None."""
    if user.is_staff:
        return Role.ADMIN
    membership = Membership.objects.filter(user=user, tenant=tenant).first()
    return membership.role if membership else None


def tenants_of(user: Any) -> QuerySet[Tenant]:
    """The tenants a user may see: all for platform admins, else their memberships."""
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(memberships__user=user)


def admin_tenants(user: Any) -> QuerySet[Tenant]:
    """The tenants whose keys, members, usage and audit log the user manages (all for
    platform admins)."""
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(pk__in=admin_tenant_ids(user))


def report_tenant_ids(user: Any) -> frozenset[int] | None:
    """The tenants whose usage reports (showback) the user may read: None for every tenant
    (platform admins), else those they administer; empty for a member, whom callers refuse."""
    return None if user.is_staff else frozenset(admin_tenant_ids(user))


# --- Rows of a tenant --------------------------------------------------------------------


def own_rows(user: Any, rows: QuerySet, owner: str) -> QuerySet:
    """``rows`` (which have a ``tenant``) as the user may see them: every row of a tenant
    they administer, only their own where they are a member (``owner`` is the lookup from a
    row to the user it belongs to, e.g. ``created_by``), none of any other tenant's.
    Platform admins see every row."""
    if user.is_staff:
        return rows
    admin_of = admin_tenant_ids(user)
    member_of = member_tenant_ids(user) - admin_of
    return rows.filter(Q(tenant_id__in=admin_of) | Q(tenant_id__in=member_of, **{owner: user}))


def keys_visible_to(user: Any) -> QuerySet[ApiKey]:
    """API keys: admins see their tenants', members the keys they made."""
    keys = ApiKey.objects.select_related("tenant", "created_by").prefetch_related("allowed_models")
    return own_rows(user, keys, owner="created_by")


def members_visible_to(user: Any) -> QuerySet[Membership]:
    """Memberships of the user's tenants: every member sees who else is in them."""
    members = Membership.objects.select_related("tenant", "user")
    return members if user.is_staff else members.filter(tenant_id__in=member_tenant_ids(user))


def audit_visible_to(user: Any) -> QuerySet[AuditLog]:
    """The audit log: platform admins see all of it, tenant admins their tenants' entries,
    members nothing."""
    entries = AuditLog.objects.select_related("tenant")
    return entries if user.is_staff else entries.filter(tenant_id__in=admin_tenant_ids(user))


def tokens_of(user: Any) -> QuerySet[AdminToken]:
    """Admin API tokens are personal: everyone sees only their own, platform admins too."""
    return AdminToken.objects.filter(user=user)


# --- Catalogue models --------------------------------------------------------------------
# Which models a tenant may call is the catalogue's rule (deployments.access), one layer up.
# This app needs it to narrow keys to their tenant's models; the catalogue hands it over when
# Django starts (DeploymentsConfig.ready), so tenants never imports the app above it.


class ModelCatalogue(Protocol):
    """What the tenants app asks of the model catalogue."""

    def models_for_tenant(self, tenant: Tenant) -> QuerySet:
        """The catalogue models the tenant may call."""

    def models_visible_to(self, user: Any) -> QuerySet:
        """The catalogue models the user may see (and name in a request)."""


_catalogue: ModelCatalogue | None = None


def provide_catalogue(catalogue: ModelCatalogue) -> None:
    """Called once at start by the app that owns the catalogue."""
    global _catalogue
    _catalogue = catalogue


def catalogue() -> ModelCatalogue:
    """The model catalogue, as its app provided it at start."""
    if _catalogue is None:
        raise ImproperlyConfigured("No model catalogue: the deployments app provides it.")
    return _catalogue
