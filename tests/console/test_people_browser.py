"""People, accounts and page layout in Debian's Chromium against the live web process.

No Docker here: the web process (gunicorn + uvicorn, as deployed) on the test database.
Screenshots go to tests/console/screenshots/ (not committed).
"""

import re
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from deployments import services as deployment_services
from metering import services as metering_services
from metering.models import UsageRollup
from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import AdminToken, Membership
from tests.conftest import PASSWORD
from tests.console.test_browser import SHOTS
from tests.liveserver import Server, serve

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

NEW_PASSWORD = "my own passphrase 2026"
MEMBER_PASSWORD = "the member's passphrase 7"


@pytest.fixture
def live(tmp_path: Path, transactional_db: None) -> Iterator[Server]:
    with serve(tmp_path / "web.log") as server:
        yield server


def _login(page: object, url: str, username: str, password: str) -> None:
    page.goto(f"{url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button:has-text('Log in')")
    page.wait_for_load_state()


def _one_time_password(page: object) -> str:
    return page.inner_text("#one-time-password").strip()


def test_people_from_invitation_to_tokens(live: Server, chromium: object) -> None:
    User = get_user_model()
    User.objects.create_user("root", "root@example.test", PASSWORD, is_staff=True)
    tenant_services.create_tenant(None, name="Acme Research", slug="acme")
    url = live.url
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()

    # A platform admin creates a user and makes them tenant admin of Acme.
    _login(page, url, "root", PASSWORD)
    page.click("nav >> text=People")
    page.click("a:has-text('New user')")
    page.fill("#id_username", "tess")
    page.fill("#id_email", "tess@example.test")
    page.click("button:has-text('Create user')")
    first_password = _one_time_password(page)
    page.screenshot(path=str(SHOTS / "people-01-user-created.png"), full_page=True)
    page.click("a:has-text('Done')")
    page.select_option("#id_tenant", "acme")
    page.select_option("#id_role", Role.ADMIN)
    page.click("button:has-text('Add')")
    page.wait_for_selector("#memberships tr[data-member=tess]")
    assert "Acme Research" in page.inner_text("#memberships")
    page.screenshot(path=str(SHOTS / "people-02-user-detail.png"), full_page=True)
    page.click("button:has-text('Log out')")

    # Tess logs in with the one-time password and must choose her own first.
    _login(page, url, "tess", first_password)
    page.wait_for_url(f"{url}/password/")
    assert page.is_visible("#forced-change")
    page.goto(f"{url}/tenants/acme/")
    assert page.url == f"{url}/password/"  # nothing else opens
    page.fill("#id_old_password", first_password)
    page.fill("#id_new_password1", NEW_PASSWORD)
    page.fill("#id_new_password2", NEW_PASSWORD)
    page.click("button:has-text('Change password')")
    page.wait_for_url(f"{url}/tenants/acme/")

    # She invites a member of Acme.
    page.click("nav >> text=People")
    page.wait_for_url(f"{url}/tenants/acme/members/")
    page.fill("#id_username", "milo")
    page.select_option("#id_role", Role.MEMBER)
    page.click("button:has-text('Invite')")
    member_password = _one_time_password(page)
    assert Membership.objects.get(user__username="milo").role == Role.MEMBER
    page.click("a:has-text('Done')")
    assert "milo" in page.inner_text("#members")
    page.screenshot(path=str(SHOTS / "people-03-members.png"), full_page=True)

    # A personal API token: created with an expiry, shown once, works, revoked.
    page.click(".usermenu >> text=tess")
    page.wait_for_url(f"{url}/profile/")
    page.fill("#id_name", "ci")
    page.select_option("#id_lifetime", "30")
    page.click("button:has-text('Create token')")
    token = page.inner_text("#new-token").strip()
    assert re.fullmatch(r"tga-[a-z0-9]+-[A-Za-z0-9_-]+", token)
    api = context.request.get(
        f"{url}/api/v1/tenants/", headers={"Authorization": f"Bearer {token}"}
    )
    assert api.status == 200 and "acme" in api.text()
    page.click("a:has-text('Done')")
    row = page.locator("tr[data-token=ci]")
    assert "active" in row.inner_text() and token not in page.content()
    page.on("dialog", lambda dialog: dialog.accept())
    row.locator("button:has-text('Revoke')").click()
    page.wait_for_selector("tr[data-token=ci] .badge:has-text('revoked')")
    assert AdminToken.objects.get(name="ci").revoked_at is not None
    fresh = chromium.new_context()
    gone = fresh.request.get(f"{url}/api/v1/tenants/", headers={"Authorization": f"Bearer {token}"})
    assert gone.status == 401
    fresh.close()
    page.screenshot(path=str(SHOTS / "people-04-profile.png"), full_page=True)
    page.click("button:has-text('Log out')")

    # The member cannot see the people page.
    _login(page, url, "milo", member_password)
    page.wait_for_url(f"{url}/password/")
    page.fill("#id_old_password", member_password)
    page.fill("#id_new_password1", MEMBER_PASSWORD)
    page.fill("#id_new_password2", MEMBER_PASSWORD)
    page.click("button:has-text('Change password')")
    page.wait_for_url(f"{url}/tenants/acme/")
    assert "People" not in page.inner_text("nav.mainnav")
    assert page.goto(f"{url}/people/").status == 403
    assert page.goto(f"{url}/tenants/acme/members/").status == 403
    context.close()


# --- Layout: no table cell clips, money in plain decimals ------------------------------------

OVERFLOWING_CELLS = """() => [...document.querySelectorAll('td, th')]
    .filter((c) => c.offsetParent !== null && c.scrollWidth > c.clientWidth + 1)
    .map((c) => c.textContent.trim().slice(0, 60))"""
SCIENTIFIC = re.compile(r"\d[eE][+-]?\d")


def _layout_data() -> dict[str, str]:
    """Long names, prices of many digits, tiny and large costs: what used to clip."""
    root = get_user_model().objects.create_user("root", "r@example.test", PASSWORD, is_staff=True)
    tenant = tenant_services.create_tenant(
        None, name="Acme Research and Development International", slug="acme"
    )
    tenant_services.issue_api_key(root, tenant, name="a-rather-long-key-name-for-ci-pipelines")
    models = []
    for name, prices in (
        ("meta-llama-3.1-70b-instruct-awq-long-name", ("0.250000", "0.125000", "1.000000")),
        ("qwen3-8b", ("1234.567891", "0.000001", "98765.432100")),
    ):
        model = deployment_services.create_model(
            None,
            served_name=name,
            source=f"org/{name}",
            params_billions=Decimal("8"),
            context_length=131072,
        )
        metering_services.set_price(None, model, *(Decimal(p) for p in prices))
        models.append(model)
    deployment_services.register_node(
        None, name="spark-one", docker_url="tcp://127.0.0.1:1", total_memory_bytes=128 * 2**30
    )
    # Inside the usage page's default period (this month), whatever the day.
    month = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    for hours, cost, model in ((0, "0.00009", models[0]), (1, "12345.678901", models[1])):
        UsageRollup.objects.create(
            hour=month + timedelta(hours=hours),
            tenant=tenant,
            model=model,
            requests=3,
            prompt_tokens=1_234_567,
            completion_tokens=89_012,
            cost=Decimal(cost),
        )
    return {
        "models": "/models/",
        "usage": "/usage/",
        "tenant": "/tenants/acme/",
        "new-deployment": "/deployments/new/",
    }


def test_tables_never_clip_at_desktop_and_phone_widths(live: Server, chromium: object) -> None:
    pages = _layout_data()
    for width in (1280, 375):
        context = chromium.new_context(viewport={"width": width, "height": 900})
        page = context.new_page()
        _login(page, live.url, "root", PASSWORD)
        for name, path in pages.items():
            assert page.goto(f"{live.url}{path}").status == 200, path
            page.wait_for_load_state("networkidle")
            page.screenshot(path=str(SHOTS / f"layout-{name}-{width}.png"), full_page=True)
            clipped = page.evaluate(OVERFLOWING_CELLS)
            assert clipped == [], (name, width, clipped)
            cells = " ".join(page.locator("td, th").all_inner_texts())
            assert not SCIENTIFIC.search(cells), (name, width)
        # Money in plain decimals, in the tables and on the chart's axis.
        page.goto(f"{live.url}/usage/")
        page.wait_for_function(
            "window.Chart && Chart.getChart(document.querySelector('canvas[id$=cost]'))"
        )
        ticks = page.evaluate(
            """() => Chart.getChart(document.querySelector('canvas[id$=cost]')).scales.y.ticks
                .map((t) => t.label)"""
        )
        assert ticks and not any(SCIENTIFIC.search(str(t)) for t in ticks), ticks
        assert "12,345.678991" in page.inner_text("body")  # 12,345.678901 + 0.00009
        page.goto(f"{live.url}/models/")
        listing = page.inner_text("main")
        assert "98,765.4321 USD" in listing and "0.25 USD" in listing
        context.close()
