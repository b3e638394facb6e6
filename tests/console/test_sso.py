"""Single sign-on rules without a browser: group mapping, role sync, SSO-only logins, checks.
(The sign-in through a real provider is tests/console/test_sso_browser.py.)"""

import pytest
from django.contrib.auth.models import AbstractBaseUser
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client

from tenants import services
from tenants.choices import Role
from tenants.models import Membership, Tenant
from tenants.sso import parse_group_map, roles_for, sync_roles
from tests.conftest import PASSWORD

SSO = {
    "TOLLGATE_OIDC_ISSUER": "https://login.example.test/realms/main",
    "OIDC_RP_CLIENT_ID": "tollgate",
    "OIDC_RP_CLIENT_SECRET": "s3cret",
    "TOLLGATE_SSO_ENABLED": True,
    "TOLLGATE_OIDC_ADMIN_GROUPS": ["tollgate-admins"],
    "TOLLGATE_OIDC_MEMBER_GROUPS": ["acme", "bravo-users=bravo"],
    "TOLLGATE_OIDC_TENANT_ADMIN_GROUPS": ["acme-leads=acme"],
}


def test_group_maps_take_bare_names_and_pairs() -> None:
    assert parse_group_map(["team-x", "ml-admins = ml"]) == {"team-x": "team-x", "ml-admins": "ml"}
    with pytest.raises(ValueError):
        parse_group_map(["=acme"])


def test_roles_follow_the_groups(settings: object) -> None:
    for name, value in SSO.items():
        setattr(settings, name, value)
    assert roles_for(["acme", "acme-leads"]).tenants == {"acme": Role.ADMIN}
    assert roles_for(["bravo-users"]).tenants == {"bravo": Role.MEMBER}
    assert roles_for(["tollgate-admins"]).platform_admin
    assert not roles_for(["marketing"]).any


def test_sync_adds_changes_and_removes_only_mapped_memberships(
    settings: object, alice: AbstractBaseUser, tenant_b: Tenant, db: None
) -> None:
    for name, value in SSO.items():
        setattr(settings, name, value)
    other = services.create_tenant(None, name="Other", slug="other")
    services.add_member(None, other, alice, Role.MEMBER)  # not mapped: left alone
    bob = services.create_user(None, "bobby", None)
    services.add_member(None, Tenant.objects.get(slug="acme"), bob, Role.ADMIN)
    sync_roles(alice, roles_for(["bravo-users"]))  # alice leaves acme, joins bravo
    held = dict(Membership.objects.filter(user=alice).values_list("tenant__slug", "role"))
    assert held == {"bravo": Role.MEMBER, "other": Role.MEMBER}
    sync_roles(alice, roles_for(["tollgate-admins"]))
    alice.refresh_from_db()
    assert alice.is_staff


def test_sso_only_leaves_local_passwords_to_the_break_glass_admin(
    settings: object, alice: AbstractBaseUser, root: AbstractBaseUser
) -> None:
    for name, value in SSO.items():
        setattr(settings, name, value)
    settings.TOLLGATE_SSO_ONLY = True
    settings.TOLLGATE_BREAK_GLASS_USERNAME = "root"
    page = Client().get("/login/").content.decode()
    assert 'id="sso-login"' in page and "Break-glass admin login" in page
    refused = Client().post("/login/", {"username": "alice", "password": PASSWORD})
    assert refused.status_code == 200 and "use single sign-on" in refused.content.decode()
    assert Client().post("/login/", {"username": "root", "password": PASSWORD}).status_code == 302


def test_without_sso_the_login_page_has_no_sso_button(client: Client, db: None) -> None:
    assert 'id="sso-login"' not in client.get("/login/").content.decode()
    assert client.get("/oidc/authenticate/").status_code == 404


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"TOLLGATE_OIDC_ISSUER": "https://idp.test", "TOLLGATE_SSO_ENABLED": False}, "E020"),
        ({**SSO, "TOLLGATE_OIDC_MEMBER_GROUPS": ["=x"]}, "E021"),
        ({"TOLLGATE_SSO_ONLY": True}, "E022"),
        ({**SSO, "TOLLGATE_OIDC_ISSUER": "idp.test"}, "E023"),
        ({**SSO, "OIDC_RP_CLIENT_SECRET": ""}, "E024"),
        (
            {
                **SSO,
                "TOLLGATE_OIDC_ADMIN_GROUPS": [],
                "TOLLGATE_OIDC_MEMBER_GROUPS": [],
                "TOLLGATE_OIDC_TENANT_ADMIN_GROUPS": [],
            },
            "W020",
        ),
        ({**SSO, "TOLLGATE_SSO_ONLY": True, "TOLLGATE_BREAK_GLASS_USERNAME": ""}, "W021"),
    ],
)
def test_sso_misconfiguration_has_stable_check_ids(
    settings: object, changes: dict, code: str, capsys: pytest.CaptureFixture
) -> None:
    for name, value in changes.items():
        setattr(settings, name, value)
    try:
        call_command("check", fail_level="WARNING")
    except SystemCheckError as exc:
        assert f"tollgate.{code}" in str(exc)
    else:
        pytest.fail(f"tollgate.{code} was not reported")


def test_sso_only_refuses_tokens_for_passwords_except_the_break_glass_admin(
    settings: object, alice: AbstractBaseUser, root: AbstractBaseUser
) -> None:
    for name, value in SSO.items():
        setattr(settings, name, value)
    settings.TOLLGATE_SSO_ONLY = True
    settings.TOLLGATE_BREAK_GLASS_USERNAME = "root"
    url = "/api/v1/auth/token/"
    body = {"username": "alice", "password": PASSWORD, "name": "ci"}
    refused = Client().post(url, body, content_type="application/json")
    assert refused.status_code == 403 and "single sign-on" in refused.json()["detail"]
    body["username"] = "root"
    assert Client().post(url, body, content_type="application/json").status_code == 201
