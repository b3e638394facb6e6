"""Single sign-on: OpenID Connect, authorization code flow with PKCE (the console's pages
for it are console/sso.py).

mozilla-django-oidc does the protocol (state, nonce, PKCE, token exchange, ID-token
signature against the provider's JWKS, userinfo). Tollgate adds:

- discovery: the provider's endpoints come from ``<issuer>/.well-known/openid-configuration``,
  read at the first sign-in (so a provider that is down never stops the console starting);
- just-in-time users, known by the provider's subject (``iss`` + ``sub``), never matched to
  a local account by name or email (an identity provider cannot take over a local admin);
- roles from group claims on every sign-in: platform admin, tenant admin, tenant member,
  through ``tenants.services`` like every other change;
- a refusal page that says why (no mapped group, deactivated, a local account of that name).
"""

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from tenants import services
from tenants.choices import Role
from tenants.models import Account, Tenant

log = logging.getLogger(__name__)

# mozilla-django-oidc setting → the discovery document's field.
ENDPOINTS = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
}


class SSORefused(Exception):
    """Sign-in through the provider worked, but Tollgate will not let this person in."""


@lru_cache(maxsize=4)
def _discover(issuer: str) -> dict[str, Any]:
    answer = requests.get(
        f"{issuer}/.well-known/openid-configuration",
        timeout=settings.OIDC_TIMEOUT,
        verify=settings.OIDC_VERIFY_SSL,
    )
    answer.raise_for_status()
    document = answer.json()
    missing = [name for name in ENDPOINTS.values() if not document.get(name)]
    if missing:
        raise ValueError(f"the provider's discovery document lacks {', '.join(missing)}")
    return document


def discovery() -> dict[str, Any]:
    return _discover(settings.TOLLGATE_OIDC_ISSUER)


def oidc_setting(attr: str, *default: Any) -> Any:
    """A mozilla-django-oidc setting, with the provider's endpoints from discovery."""
    if attr in ENDPOINTS:
        return discovery()[ENDPOINTS[attr]]
    if default:
        return getattr(settings, attr, default[0])
    return getattr(settings, attr)


# --- Group mapping ------------------------------------------------------------------------


def parse_group_map(entries: list[str]) -> dict[str, str]:
    """``["team-x", "ml-admins=ml"]`` → ``{"team-x": "team-x", "ml-admins": "ml"}``."""
    mapping = {}
    for entry in entries:
        group, _, slug = entry.partition("=")
        group, slug = group.strip(), (slug or group).strip()
        if not group or not slug:
            raise ValueError(f"{entry!r} is not a group or group=tenant-slug")
        mapping[group] = slug
    return mapping


@dataclass
class Roles:
    """What a person's groups make them in Tollgate."""

    platform_admin: bool = False
    tenants: dict[str, str] = field(default_factory=dict)  # slug → role

    @property
    def any(self) -> bool:
        return self.platform_admin or bool(self.tenants)


def roles_for(groups: list[str]) -> Roles:
    roles = Roles(platform_admin=bool(set(groups) & set(settings.TOLLGATE_OIDC_ADMIN_GROUPS)))
    members = parse_group_map(settings.TOLLGATE_OIDC_MEMBER_GROUPS)
    admins = parse_group_map(settings.TOLLGATE_OIDC_TENANT_ADMIN_GROUPS)
    for group in groups:
        if group in members:
            roles.tenants.setdefault(members[group], Role.MEMBER)
        if group in admins:
            roles.tenants[admins[group]] = Role.ADMIN
    return roles


def mapped_slugs() -> set[str]:
    """Tenants whose memberships single sign-on manages (others are left alone)."""
    return set(parse_group_map(settings.TOLLGATE_OIDC_MEMBER_GROUPS).values()) | set(
        parse_group_map(settings.TOLLGATE_OIDC_TENANT_ADMIN_GROUPS).values()
    )


def _groups(claims: dict[str, Any]) -> list[str]:
    value = claims.get(settings.TOLLGATE_OIDC_GROUPS_CLAIM) or []
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    return [str(g) for g in value]


def sync_roles(user: AbstractBaseUser, roles: Roles) -> None:
    """Make the user's platform-admin flag and mapped memberships what the groups say."""
    if user.is_staff != roles.platform_admin:
        services.update_user(None, user, is_staff=roles.platform_admin)
    tenants = {t.slug: t for t in Tenant.objects.filter(slug__in=mapped_slugs())}
    held = {m.tenant.slug: m for m in user.memberships.select_related("tenant")}
    for slug, role in roles.tenants.items():
        tenant = tenants.get(slug)
        if tenant is None:
            log.warning("sso: group maps to tenant %r, which does not exist", slug)
        elif slug not in held:
            services.add_member(None, tenant, user, role)
        elif held[slug].role != role:
            _keep_going(services.change_role, None, held[slug], role)
    for slug, membership in held.items():
        if slug in tenants and slug not in roles.tenants:
            _keep_going(services.remove_member, None, membership)


def _keep_going(change: Any, *args: Any) -> None:
    # A tenant keeps its last admin; the group change shows at a later sign-in.
    try:
        change(*args)
    except ValidationError as exc:
        log.warning("sso: %s", " ".join(exc.messages))


# --- Backend --------------------------------------------------------------------


class SSOBackend(OIDCAuthenticationBackend):
    """Authenticates a provider's callback; every other authenticate() call passes by."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The parent reads the provider's endpoints here; that waits for a real sign-in.
        self.UserModel = get_user_model()

    get_settings = staticmethod(oidc_setting)

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> AbstractBaseUser | None:
        if not settings.TOLLGATE_SSO_ENABLED or request is None or "code" not in request.GET:
            return None
        for name in (*ENDPOINTS, "OIDC_RP_CLIENT_ID", "OIDC_RP_CLIENT_SECRET"):
            setattr(self, name, oidc_setting(name))
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        try:
            return super().authenticate(request, **kwargs)
        except SSORefused as exc:
            request.sso_refusal = str(exc)
        except Exception as exc:  # noqa: BLE001 - the provider's fault or ours: a clear page
            log.warning("sso: sign-in failed: %s: %s", exc.__class__.__name__, exc)
            request.sso_refusal = "Single sign-on failed; try again or ask your administrator."
        return None

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return bool(claims.get("sub"))

    def _subject(self, claims: dict[str, Any]) -> str:
        return f"{discovery().get('issuer', settings.TOLLGATE_OIDC_ISSUER)} {claims['sub']}"

    def filter_users_by_claims(self, claims: dict[str, Any]) -> Any:
        return self.UserModel.objects.filter(account__sso_subject=self._subject(claims))

    def create_user(self, claims: dict[str, Any]) -> AbstractBaseUser:
        roles = self._roles_or_refuse(claims)
        username = str(claims.get(settings.TOLLGATE_OIDC_USERNAME_CLAIM) or claims["sub"])[:150]
        if self.UserModel.objects.filter(username=username).exists():
            raise SSORefused(
                f"A local Tollgate account is already called {username!r}; a platform admin "
                "must rename or remove it before its owner can sign in with single sign-on."
            )
        user = services.create_user(None, username, None, email=claims.get("email") or "")
        Account.objects.filter(user=user).update(sso_subject=self._subject(claims))
        sync_roles(user, roles)
        return user

    def update_user(self, user: AbstractBaseUser, claims: dict[str, Any]) -> AbstractBaseUser:
        if not user.is_active:
            raise SSORefused(f"The account {user} is deactivated in Tollgate.")
        sync_roles(user, self._roles_or_refuse(claims))
        user.refresh_from_db()
        return user

    def _roles_or_refuse(self, claims: dict[str, Any]) -> Roles:
        roles = roles_for(_groups(claims))
        if not roles.any:
            name = claims.get(settings.TOLLGATE_OIDC_USERNAME_CLAIM) or claims.get("sub")
            raise SSORefused(
                f"You signed in as {name}, but none of your groups gives access to Tollgate. "
                "Ask your administrator to add you to a group for a Tollgate tenant."
            )
        return roles
