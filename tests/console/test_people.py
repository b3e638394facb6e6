"""People in the console: users, memberships and roles, one-time passwords changed at the
first login, and personal admin API tokens on the profile page."""

import re
from collections.abc import Callable

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.management import call_command
from django.test import Client

from tenants.choices import Role
from tenants.models import Account, AdminToken, Membership, Tenant
from tests.conftest import PASSWORD

User = get_user_model()
NEW_PASSWORD = "a brand new passphrase 77"
Web = Callable[[AbstractBaseUser], Client]


def _one_time_password(html: str) -> str:
    return re.search(r'<code id="one-time-password">([^<]+)</code>', html).group(1)


def _log_in(username: str, password: str) -> Client:
    client = Client()
    answer = client.post("/login/", {"username": username, "password": password})
    assert answer.status_code == 302, answer.content[:300]
    return client


def test_platform_admin_creates_a_tenant_admin_who_must_change_the_password_first(
    web: Web, root: AbstractBaseUser, tenant_a: Tenant
) -> None:
    page = web(root).post(
        "/people/new/",
        {"username": "dora", "email": "dora@example.test", "tenant": "acme", "role": Role.ADMIN},
    )
    assert page.status_code == 200 and page["Cache-Control"] == "no-store"
    password = _one_time_password(page.content.decode())
    assert Membership.objects.get(user__username="dora", tenant=tenant_a).role == Role.ADMIN

    dora = _log_in("dora", password)
    # Nothing opens before the password is changed: pages lead to the password page…
    for path in ("/", "/tenants/acme/", "/profile/", "/keys/new/"):
        answer = dora.get(path)
        assert answer.status_code == 302 and answer["Location"] == "/password/", path
    # …and the admin API answers 403 with a problem document.
    api = dora.get("/api/v1/tenants/")
    assert api.status_code == 403 and api["Content-Type"] == "application/problem+json"
    assert "password" in api.json()["detail"]
    changed = dora.post(
        "/password/",
        {"old_password": password, "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )
    assert changed.status_code == 302
    assert dora.get("/tenants/acme/").status_code == 200
    assert not Account.objects.get(user__username="dora").must_change_password
    assert _log_in("dora", NEW_PASSWORD).get("/tenants/acme/").status_code == 200


def test_a_taken_username_is_a_form_error(web: Web, root: AbstractBaseUser, bob: object) -> None:
    page = web(root).post("/people/new/", {"username": "bob", "role": Role.MEMBER})
    assert page.status_code == 400 and "already exists" in page.content.decode()


def test_tenant_admin_invites_and_removes_members_of_their_tenant_only(
    web: Web, alice: AbstractBaseUser, bob: AbstractBaseUser, carol: AbstractBaseUser
) -> None:
    client = web(alice)
    page = client.get("/people/", follow=True)
    assert page.redirect_chain[-1][0] == "/tenants/acme/members/"
    assert "bob" in page.content.decode() and "carol" not in page.content.decode()
    invited = client.post("/tenants/acme/members/", {"username": "erin", "role": Role.MEMBER})
    assert invited.status_code == 200 and _one_time_password(invited.content.decode())
    erin = Membership.objects.get(user__username="erin")
    assert erin.tenant.slug == "acme" and erin.role == Role.MEMBER
    assert not User.objects.get(username="erin").is_staff
    # A tenant admin cannot make platform admins, whatever the form is sent.
    client.post(
        "/tenants/acme/members/", {"username": "mallory", "role": Role.MEMBER, "is_staff": "on"}
    )
    assert not User.objects.get(username="mallory").is_staff

    bob_in_a = Membership.objects.get(user=bob)
    assert client.post(f"/tenants/acme/members/{bob_in_a.pk}/remove/").status_code == 302
    assert not Membership.objects.filter(user=bob).exists()
    # The last tenant admin stays.
    own = Membership.objects.get(user=alice)
    client.post(f"/tenants/acme/members/{own.pk}/role/", {"role": Role.MEMBER}, follow=True)
    assert Membership.objects.get(user=alice).role == Role.ADMIN

    # Another tenant's members page and memberships are 404, as if they did not exist.
    carol_in_b = Membership.objects.get(user=carol)
    assert client.get("/tenants/bravo/members/").status_code == 404
    assert client.post(f"/tenants/acme/members/{carol_in_b.pk}/remove/").status_code == 404
    assert client.post(f"/tenants/bravo/members/{carol_in_b.pk}/remove/").status_code == 404
    assert Membership.objects.filter(user=carol).exists()
    # The platform admins' pages are not theirs.
    assert client.get("/people/new/").status_code == 403
    assert client.get(f"/people/{carol.pk}/").status_code == 403


def test_members_cannot_see_the_people_pages(web: Web, bob: AbstractBaseUser) -> None:
    client = web(bob)
    assert client.get("/people/").status_code == 403
    assert client.get("/tenants/acme/members/").status_code == 403
    assert client.post("/tenants/acme/members/", {"username": "x"}).status_code == 403
    assert client.get("/tenants/bravo/members/").status_code == 404
    assert "/people/" not in client.get("/tenants/acme/").content.decode()


def test_platform_admin_manages_memberships_deactivates_and_resets(
    web: Web, root: AbstractBaseUser, bob: AbstractBaseUser, tenant_b: Tenant
) -> None:
    client = web(root)
    assert "bob" in client.get("/people/").content.decode()
    client.post(f"/people/{bob.pk}/", {"tenant": "bravo", "role": Role.MEMBER})
    in_b = Membership.objects.get(user=bob, tenant=tenant_b)
    assert in_b.role == Role.MEMBER
    back = client.post(
        f"/tenants/bravo/members/{in_b.pk}/role/",
        {"role": Role.ADMIN, "next": f"/people/{bob.pk}/"},
    )
    assert back["Location"] == f"/people/{bob.pk}/"
    in_b.refresh_from_db()
    assert in_b.role == Role.ADMIN
    # Bravo's only admin stays its admin.
    client.post(f"/tenants/bravo/members/{in_b.pk}/role/", {"role": Role.MEMBER})
    in_b.refresh_from_db()
    assert in_b.role == Role.ADMIN

    reset = client.post(f"/people/{bob.pk}/reset-password/")
    password = _one_time_password(reset.content.decode())
    bob.refresh_from_db()
    assert bob.check_password(password) and not bob.check_password(PASSWORD)
    assert Account.objects.get(user=bob).must_change_password

    session = _log_in("bob", password)
    client.post(f"/people/{bob.pk}/status/?active=0")
    bob.refresh_from_db()
    assert not bob.is_active
    # The deactivated user's session ends with the next request.
    assert session.get("/tenants/acme/")["Location"].startswith("/login/")
    # Nobody deactivates themselves.
    client.post(f"/people/{root.pk}/status/?active=0")
    root.refresh_from_db()
    assert root.is_active


def test_personal_api_tokens_are_shown_once_listed_and_revoked(
    web: Web, alice: AbstractBaseUser, carol: AbstractBaseUser
) -> None:
    client = web(alice)
    created = client.post("/profile/tokens/new/", {"name": "laptop", "lifetime": "30"})
    assert created["Cache-Control"] == "no-store"
    plaintext = re.search(r'<code id="new-token">([^<]+)</code>', created.content.decode()).group(1)
    token = AdminToken.objects.get(user=alice, name="laptop")
    assert plaintext.startswith(f"tga-{token.prefix}-") and plaintext not in token.secret_hash
    assert token.expires_at is not None
    profile = client.get("/profile/").content.decode()
    assert "laptop" in profile and plaintext not in profile

    api = Client(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert api.get("/api/v1/tenants/").status_code == 200
    # Someone else's token is not theirs to revoke: 404.
    theirs = web(carol).post(f"/profile/tokens/{token.pk}/revoke/")
    assert theirs.status_code == 404
    assert client.post(f"/profile/tokens/{token.pk}/revoke/").status_code == 302
    assert api.get("/api/v1/tenants/").status_code == 401
    assert "revoked" in client.get("/profile/").content.decode()


def test_a_generated_first_admin_password_must_be_changed(db: None) -> None:
    from io import StringIO

    out = StringIO()
    call_command("bootstrap", stdout=out)
    assert Account.objects.get(user__username="admin").must_change_password


@pytest.mark.parametrize("path", ["/profile/", "/people/"])
def test_pages_need_a_login(client: Client, path: str, db: None) -> None:
    assert client.get(path)["Location"].startswith("/login/")


def test_audit_values_read_as_text_not_python(
    web: Web, root: AbstractBaseUser, tenant_a: Tenant
) -> None:
    from tenants import services

    services.update_tenant(root, tenant_a, quota_tokens=None, requests_per_minute=None)
    services.update_tenant(root, tenant_a, quota_tokens=5000, name="Acme Two")
    page = web(root).get("/audit/").content.decode()
    assert "None" not in page and "[" not in page.split("<table")[-1].split("</table>")[0]
    assert "600 → none" in page and "none → 5000" in page and "Acme Research → Acme Two" in page
