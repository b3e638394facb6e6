"""Rules for tenants, members, API keys and admin tokens. Every view and command calls these."""

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from core.changes import publish_change
from core.errors import Conflict
from tenants.access import catalogue
from tenants.audit import Actor, diff, record, snapshot
from tenants.choices import AuditAction, Role, TenantStatus
from tenants.keys import ADMIN_TOKEN, TENANT_KEY, generate_key
from tenants.models import (
    KEY_FIELDS,
    LIMIT_FIELDS,
    MEMBERSHIP_FIELDS,
    TENANT_FIELDS,
    TOKEN_FIELDS,
    USER_FIELDS,
    Account,
    AdminToken,
    ApiKey,
    Membership,
    Tenant,
)

# --- Tenants ----------------------------------------------------------------------------

PLATFORM_SLUG = "platform"


def _unique_slug(name: str) -> str:
    base = slugify(name)[:56] or "tenant"
    slug, n = base, 1
    while slug == PLATFORM_SLUG or Tenant.objects.filter(slug=slug).exists():
        n += 1
        slug = f"{base}-{n}"
    return slug


@transaction.atomic
def create_tenant(
    actor: Actor, name: str, allowed_models: list | None = None, **fields: Any
) -> Tenant:
    """A new tenant with the default limits unless given; slug derived from the name."""
    fields.setdefault("slug", _unique_slug(name))
    if fields["slug"] == PLATFORM_SLUG:
        raise ValidationError({"slug": f"{PLATFORM_SLUG!r} is Tollgate's own tenant's slug."})
    tenant = Tenant(name=name, **fields)
    tenant.full_clean()
    tenant.save()
    if allowed_models is not None:
        tenant.allowed_models.set(allowed_models)
    record(
        actor, AuditAction.CREATE, tenant, tenant=tenant, changes=snapshot(tenant, TENANT_FIELDS)
    )
    return tenant


def platform_tenant() -> Tenant:
    """Tollgate's own tenant, made on first use: platform admins' playground chats bill to it,
    and showback leaves it out unless asked for by name (``?tenant=platform``)."""
    tenant = Tenant.objects.filter(slug=PLATFORM_SLUG).first()
    if tenant is None:
        with transaction.atomic():
            tenant, _ = Tenant.objects.get_or_create(
                slug=PLATFORM_SLUG,
                defaults={"name": "Platform (staff tests)", "internal": True, "quota_tokens": None},
            )
    if not tenant.internal:
        raise ValidationError(
            {"tenant": f"A customer tenant uses the slug {PLATFORM_SLUG!r}; rename it first."}
        )
    return tenant


@transaction.atomic
def update_tenant(
    actor: Actor, tenant: Tenant, allowed_models: list | None = None, **changes: Any
) -> Tenant:
    """Change a tenant's settings; keys whose limits are now looser are tightened to match."""
    before = snapshot(tenant, TENANT_FIELDS)
    for name, value in changes.items():
        setattr(tenant, name, value)
    tenant.full_clean()
    tenant.save()
    if allowed_models is not None:
        tenant.allowed_models.set(allowed_models)
    _clamp_key_limits(tenant)
    record(
        actor,
        AuditAction.UPDATE,
        tenant,
        tenant=tenant,
        changes=diff(before, snapshot(tenant, TENANT_FIELDS)),
    )
    publish_change("tenant", tenant.pk)
    return tenant


def _clamp_key_limits(tenant: Tenant) -> None:
    # A key may never be looser than its tenant: lower any key limit above the new ceiling.
    for field in LIMIT_FIELDS:
        ceiling = getattr(tenant, field)
        if ceiling is not None:
            tenant.api_keys.filter(**{f"{field}__gt": ceiling}).update(**{field: ceiling})


def set_tenant_status(actor: Actor, tenant: Tenant, status: str) -> Tenant:
    """Suspend or reactivate a tenant; a suspended tenant's keys stop working at once."""
    if status not in TenantStatus.values:
        raise ValidationError({"status": f"Unknown status {status!r}."})
    updated = Tenant.objects.filter(pk=tenant.pk).exclude(status=status).update(status=status)
    tenant.refresh_from_db()
    if updated:
        action = AuditAction.SUSPEND if status == TenantStatus.SUSPENDED else AuditAction.ACTIVATE
        record(actor, action, tenant, tenant=tenant)
        publish_change("tenant", tenant.pk)
    return tenant


# --- Members ----------------------------------------------------------------------------


def add_member(
    actor: Actor, tenant: Tenant, user: AbstractBaseUser, role: str = Role.MEMBER
) -> Membership:
    """Give a user a role in a tenant."""
    if role not in Role.values:
        raise ValidationError({"role": f"Unknown role {role!r}."})
    try:
        with transaction.atomic():
            membership = Membership.objects.create(tenant=tenant, user=user, role=role)
    except IntegrityError:
        raise Conflict({"user": f"{user} is already a member of {tenant}."}) from None
    record(
        actor,
        AuditAction.CREATE,
        membership,
        tenant=tenant,
        changes=snapshot(membership, MEMBERSHIP_FIELDS),
    )
    return membership


def change_role(actor: Actor, membership: Membership, role: str) -> Membership:
    """Change a member's role, keeping at least one tenant admin."""
    if role not in Role.values:
        raise ValidationError({"role": f"Unknown role {role!r}."})
    if membership.role == Role.ADMIN and role != Role.ADMIN:
        _ensure_another_admin(membership)
    before = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    record(
        actor,
        AuditAction.UPDATE,
        membership,
        tenant=membership.tenant,
        changes={"role": [before, role]},
    )
    return membership


def remove_member(actor: Actor, membership: Membership) -> None:
    """Take a user out of a tenant, keeping at least one tenant admin."""
    if membership.role == Role.ADMIN:
        _ensure_another_admin(membership)
    record(actor, AuditAction.DELETE, membership, tenant=membership.tenant)
    membership.delete()


def _ensure_another_admin(membership: Membership) -> None:
    others = Membership.objects.filter(tenant=membership.tenant, role=Role.ADMIN).exclude(
        pk=membership.pk
    )
    if not others.exists():
        raise Conflict({"role": "A tenant must keep at least one tenant admin."})


# --- API keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedKey:
    """A stored key and its plaintext, which exists only in this object and the response."""

    key: ApiKey
    plaintext: str


@transaction.atomic
def issue_api_key(
    actor: Actor,
    tenant: Tenant,
    name: str,
    expires_at: datetime | None = None,
    allowed_models: list | None = None,
    **limits: Any,
) -> IssuedKey:
    """A new inference key for the tenant; the plaintext is returned once and never stored."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "The expiry must be in the future."})
    new = generate_key(TENANT_KEY)
    user = actor if actor is not None and actor.is_authenticated else None
    key = ApiKey(
        tenant=tenant,
        name=name,
        prefix=new.prefix,
        secret_hash=new.secret_hash,
        created_by=user,
        expires_at=expires_at,
        **limits,
    )
    key.full_clean()
    key.save()
    if allowed_models:
        _check_models_allowed(tenant, allowed_models)
        key.allowed_models.set(allowed_models)
    record(actor, AuditAction.CREATE, key, tenant=tenant, changes=snapshot(key, KEY_FIELDS))
    publish_change("api_key", key.prefix)
    return IssuedKey(key=key, plaintext=new.plaintext)


def _check_models_allowed(tenant: Tenant, models: list) -> None:
    allowed = set(catalogue().models_for_tenant(tenant).values_list("pk", flat=True))
    refused = [str(m) for m in models if m.pk not in allowed]
    if refused:
        raise ValidationError(
            {"allowed_models": f"Not available to this tenant: {', '.join(refused)}."}
        )


@transaction.atomic
def update_api_key(
    actor: Actor, key: ApiKey, allowed_models: list | None = None, **changes: Any
) -> ApiKey:
    """Rename a key or change its expiry, limits or model restriction."""
    expires_at = changes.get("expires_at")
    if expires_at is not None and expires_at != key.expires_at and expires_at <= timezone.now():
        raise ValidationError(
            {"expires_at": "The expiry must be in the future; revoke the key to end it now."}
        )
    before = snapshot(key, KEY_FIELDS)
    for name, value in changes.items():
        setattr(key, name, value)
    key.full_clean()
    key.save()
    if allowed_models is not None:
        _check_models_allowed(key.tenant, allowed_models)
        key.allowed_models.set(allowed_models)
    record(
        actor,
        AuditAction.UPDATE,
        key,
        tenant=key.tenant,
        changes=diff(before, snapshot(key, KEY_FIELDS)),
    )
    publish_change("api_key", key.prefix)
    return key


def revoke_api_key(actor: Actor, key: ApiKey) -> ApiKey:
    """Revoke a key for good; a second revoke changes nothing."""
    now = timezone.now()
    updated = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now)
    key.refresh_from_db()
    if updated:
        record(actor, AuditAction.REVOKE, key, tenant=key.tenant)
        publish_change("api_key", key.prefix)
    return key


# --- Admin API tokens ---------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedToken:
    token: AdminToken
    plaintext: str


def issue_admin_token(
    actor: AbstractBaseUser, name: str, expires_at: datetime | None = None
) -> IssuedToken:
    """A new admin API token for the acting user; shown once."""
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "The expiry must be in the future."})
    new = generate_key(ADMIN_TOKEN)
    token = AdminToken.objects.create(
        user=actor, name=name, prefix=new.prefix, secret_hash=new.secret_hash, expires_at=expires_at
    )
    record(actor, AuditAction.CREATE, token, changes=snapshot(token, TOKEN_FIELDS))
    return IssuedToken(token=token, plaintext=new.plaintext)


def revoke_admin_token(actor: Actor, token: AdminToken) -> AdminToken:
    """Revoke an admin API token; a second revoke changes nothing."""
    updated = AdminToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    token.refresh_from_db()
    if updated:
        record(actor, AuditAction.REVOKE, token)
    return token


# --- Users ------------------------------------------------------------------------------


def create_user(
    actor: Actor,
    username: str,
    password: str | None,
    email: str = "",
    is_staff: bool = False,
    must_change_password: bool = False,
    **extra: Any,
) -> AbstractBaseUser:
    """A console user; platform admins are staff users. The password is validated.

    ``must_change_password``: the password was chosen for the user, who sets their own at
    the first login before anything else opens.
    """
    from django.contrib.auth import get_user_model
    from django.contrib.auth.password_validation import validate_password

    User = get_user_model()
    user = User(username=username, email=email, is_staff=is_staff, **extra)
    if password:
        try:
            validate_password(password, user)
        except ValidationError as exc:
            raise ValidationError({"password": exc.messages}) from None
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.full_clean(exclude=["password"])
    user.save()
    Account.objects.create(user=user, must_change_password=must_change_password)
    changes = snapshot(user, USER_FIELDS) | ({"password": "set"} if password else {})
    record(actor, AuditAction.CREATE, user, changes=changes)
    return user


@dataclass(frozen=True)
class InvitedUser:
    """A new user and the one-time password to hand them, which exists only here."""

    user: AbstractBaseUser
    password: str


def one_time_password() -> str:
    return secrets.token_urlsafe(12)


@transaction.atomic
def invite_user(
    actor: Actor,
    username: str,
    email: str = "",
    is_staff: bool = False,
    tenant: Tenant | None = None,
    role: str = Role.MEMBER,
) -> InvitedUser:
    """A new console user with a one-time password (changed at the first login), given a
    role in ``tenant`` when one is named."""
    password = one_time_password()
    user = create_user(
        actor, username, password, email=email, is_staff=is_staff, must_change_password=True
    )
    if tenant is not None:
        add_member(actor, tenant, user, role)
    return InvitedUser(user=user, password=password)


def reset_password(actor: Actor, user: AbstractBaseUser) -> str:
    """A new one-time password for the user (returned once); their old one stops working."""
    if not user.is_active:
        raise ValidationError({"detail": f"{user} is deactivated; activate the account first."})
    password = one_time_password()
    user.set_password(password)
    user.save(update_fields=["password"])
    Account.objects.update_or_create(user=user, defaults={"must_change_password": True})
    record(actor, AuditAction.UPDATE, user, changes={"password": "reset to a one-time password"})
    return password


def password_login_allowed(username: str) -> bool:
    """Whether a local password may sign this user in: always, unless single sign-on is
    the only way in (``TOLLGATE_SSO_ONLY``), which leaves only the break-glass admin's."""
    from django.conf import settings

    if not (settings.TOLLGATE_SSO_ENABLED and settings.TOLLGATE_SSO_ONLY):
        return True
    return bool(username) and username == settings.TOLLGATE_BREAK_GLASS_USERNAME


def must_change_password(user: AbstractBaseUser) -> bool:
    return Account.objects.filter(user=user, must_change_password=True).exists()


def password_changed(user: AbstractBaseUser) -> None:
    """The user chose their own password: the console opens."""
    Account.objects.filter(user=user).update(must_change_password=False)
    record(user, AuditAction.UPDATE, user, changes={"password": "changed by the user"})


def set_user_active(actor: Actor, user: AbstractBaseUser, active: bool) -> AbstractBaseUser:
    """Deactivate (sessions and admin tokens stop working at once) or reactivate a user.

    Nobody deactivates themselves, and the last active platform admin stays.
    """
    from django.contrib.auth import get_user_model

    if not active and actor is not None and getattr(actor, "pk", None) == user.pk:
        raise ValidationError({"detail": "You cannot deactivate your own account."})
    if not active and user.is_staff:
        admins = get_user_model().objects.filter(is_staff=True, is_active=True)
        if not admins.exclude(pk=user.pk).exists():
            raise ValidationError({"detail": "The last active platform admin must stay."})
    return update_user(actor, user, is_active=active)


def update_user(
    actor: Actor, user: AbstractBaseUser, password: str | None = None, **changes: Any
) -> AbstractBaseUser:
    """Change a console user's details, role flags or password."""
    from django.contrib.auth.password_validation import validate_password

    if actor is not None and actor.pk == user.pk:
        # Nobody locks themselves out: another platform admin has to do it.
        for flag in ("is_staff", "is_active"):
            if changes.get(flag) is False and getattr(user, flag):
                raise Conflict({flag: "You cannot take this away from yourself."})
    before = snapshot(user, USER_FIELDS)
    for name, value in changes.items():
        setattr(user, name, value)
    if password:
        try:
            validate_password(password, user)
        except ValidationError as exc:
            raise ValidationError({"password": exc.messages}) from None
        user.set_password(password)
    user.full_clean(exclude=["password"])
    user.save()
    after = snapshot(user, USER_FIELDS)
    record(
        actor,
        AuditAction.UPDATE,
        user,
        changes={**diff(before, after), **({"password": "changed"} if password else {})},
    )
    return user


def delete_tenant(actor: Actor, tenant: Tenant) -> None:
    """Remove a tenant that was never billed; one with usage is suspended instead."""
    if tenant.usage_events.exists():
        raise Conflict({"detail": "The tenant has usage on record; suspend it instead."})
    record(actor, AuditAction.DELETE, tenant)
    publish_change("tenant", tenant.pk)
    tenant.delete()


# --- Admission -------------------------------------------------------------------------------


MAX_BOOST_MINUTES = 24 * 60


def grant_interactive(actor: Actor, tenant: Tenant, minutes: int) -> Tenant:
    """Serve the tenant as P0 for the next ``minutes`` (0 ends a boost now)."""
    if not 0 <= minutes <= MAX_BOOST_MINUTES:
        raise ValidationError({"minutes": f"Give 0 to {MAX_BOOST_MINUTES} minutes."})
    until = timezone.now() + timedelta(minutes=minutes) if minutes else None
    Tenant.objects.filter(pk=tenant.pk).update(priority_boost_until=until)
    tenant.refresh_from_db()
    record(
        actor,
        AuditAction.ACTION,
        tenant,
        tenant=tenant,
        changes={"priority_boost_until": until.isoformat() if until else None},
    )
    publish_change("tenant", tenant.pk)
    return tenant


def issue_child_key(parent: ApiKey, name: str, expires_at: datetime) -> IssuedKey:
    """A key Tollgate uses itself on behalf of ``parent`` (batch work); revoke it when done."""
    new = generate_key(TENANT_KEY)
    key = ApiKey.objects.create(
        tenant=parent.tenant,
        parent=parent,
        name=name[:100],
        prefix=new.prefix,
        secret_hash=new.secret_hash,
        expires_at=expires_at,
    )
    publish_change("api_key", key.prefix)
    return IssuedKey(key=key, plaintext=new.plaintext)
