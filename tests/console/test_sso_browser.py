"""Single sign-on in Debian's Chromium, through a real OpenID Connect provider.

The provider is django-oauth-toolkit in OIDC mode (tests/oidc_provider), a separate Django
project with its own SQLite database, started here on loopback; Tollgate's web process runs
with SSO settings pointing at it. The browser signs in at the provider, comes back through
the authorization code flow with PKCE, and the group claim decides what the person is.
"""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import Account, Membership
from tests.console.test_browser import SHOTS
from tests.gateway.conftest import free_port, stop, wait_listening
from tests.liveserver import ROOT, Server, serve

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CLIENT_ID, CLIENT_SECRET = "tollgate-console", "a-client-secret-for-tests-only-123"
USERS = [
    {
        "username": "xavier",
        "email": "x@example.test",
        "password": "xavier-pw-1",
        "groups": ["team-x"],
    },
    {
        "username": "ada",
        "email": "ada@example.test",
        "password": "ada-pw-1",
        "groups": ["tollgate-admins"],
    },
    {
        "username": "uma",
        "email": "uma@example.test",
        "password": "uma-pw-1",
        "groups": ["marketing"],
    },
]


@pytest.fixture
def sso(tmp_path: Path, transactional_db: None) -> Iterator[tuple[Server, str]]:
    """The provider on one loopback port, Tollgate (SSO on) on another."""
    provider_port, tollgate_port = free_port(), free_port()
    config = tmp_path / "provider.json"
    config.write_text(
        json.dumps(
            {
                "port": provider_port,
                "database": str(tmp_path / "provider.sqlite3"),
                "users": USERS,
                "client": {
                    "id": CLIENT_ID,
                    "secret": CLIENT_SECRET,
                    "redirect_uri": f"http://127.0.0.1:{tollgate_port}/oidc/callback/",
                },
            }
        )
    )
    provider = subprocess.Popen(
        [sys.executable, "-m", "tests.oidc_provider.serve", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "provider.log", "w"),
    )
    try:
        wait_listening(provider_port, provider, timeout=60)
        issuer = f"http://127.0.0.1:{provider_port}/o"
        with serve(
            tmp_path / "web.log",
            port=tollgate_port,
            TOLLGATE_OIDC_ISSUER=issuer,
            TOLLGATE_OIDC_CLIENT_ID=CLIENT_ID,
            TOLLGATE_OIDC_CLIENT_SECRET=CLIENT_SECRET,
            TOLLGATE_OIDC_ADMIN_GROUPS="tollgate-admins",
            TOLLGATE_OIDC_MEMBER_GROUPS="team-x",
            TOLLGATE_OIDC_TENANT_ADMIN_GROUPS="team-x-leads=team-x",
        ) as server:
            yield server, issuer
    finally:
        stop(provider)


def _sign_in(browser: object, url: str, username: str, password: str) -> object:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(f"{url}/login/")
    page.click("#sso-login")
    page.wait_for_selector("#idp-username")  # the provider's own login page
    page.fill("#idp-username", username)
    page.fill("#idp-password", password)
    page.click("#idp-submit")
    page.wait_for_url(f"{url}/**")
    page.wait_for_load_state()
    return page


def test_sso_group_claims_make_members_and_admins_and_refuse_the_rest(
    sso: tuple[Server, str], chromium: object
) -> None:
    server, issuer = sso
    team = tenant_services.create_tenant(None, name="Team X", slug="team-x")
    tenant_services.create_tenant(None, name="Other Corp", slug="other")
    User = get_user_model()

    page = _sign_in(chromium, server.url, "xavier", "xavier-pw-1")
    page.wait_for_url(f"{server.url}/tenants/team-x/")
    assert "Team X" in page.inner_text("body") and "Other Corp" not in page.inner_text("body")
    page.screenshot(path=str(SHOTS / "sso-01-member-home.png"), full_page=True)
    xavier = User.objects.get(username="xavier")
    assert not xavier.is_staff and xavier.email == "x@example.test"
    assert Membership.objects.get(user=xavier).tenant == team
    assert Membership.objects.get(user=xavier).role == Role.MEMBER
    assert Account.objects.get(user=xavier).sso_subject.startswith(f"{issuer} ")
    assert not xavier.has_usable_password()
    assert page.goto(f"{server.url}/people/").status == 403

    page = _sign_in(chromium, server.url, "ada", "ada-pw-1")
    page.wait_for_url(f"{server.url}/dashboard/")
    assert User.objects.get(username="ada").is_staff

    page = _sign_in(chromium, server.url, "uma", "uma-pw-1")
    page.wait_for_selector("#sso-refused")
    text = page.inner_text("#sso-refused")
    assert "none of your groups gives access to Tollgate" in text and "uma" in text
    page.screenshot(path=str(SHOTS / "sso-02-refused.png"), full_page=True)
    assert not User.objects.filter(username="uma").exists()
    assert "Traceback" not in server.log_text()
