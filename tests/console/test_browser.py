"""The console in Debian's Chromium (Playwright) against a live server, end to end.

A gunicorn + uvicorn server runs config.asgi on the test database (so data is committed:
``transactional_db``), a real Celery worker consumes the node's queue and starts the
simulator engine as a Docker container, the gateway routes to it and meters requests.
Screenshots of the main pages go to tests/console/screenshots/ (not committed).
"""

import csv
import io
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from django.conf import settings as django_settings
from django.db import connections
from django.db.models import F, Sum

from deployments import fleet
from deployments import services as deployment_services
from deployments.models import Node
from deployments.profiles import ensure_builtin_profiles
from metering import ingest
from metering import services as metering_services
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.access import tenants_of
from tenants.choices import Role
from tests.browser import CHROMIUM_ARGS, tolerate_network_changes
from tests.conftest import PASSWORD
from tests.databases import database_url
from tests.deployments.conftest import SIM_IMAGE, stack  # noqa: F401 - fixture
from tests.gateway.conftest import free_port, stop, wait_listening

pytestmark = [pytest.mark.browser, pytest.mark.docker, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "tests" / "console" / "screenshots"
PREFIX = f"consoletest-{secrets.token_hex(5)}"


@pytest.fixture(autouse=True)
def redis_namespace(settings: object) -> str:
    """Share the live server's and the worker's Redis prefix (invalidations, usage stream)."""
    settings.TOLLGATE_REDIS_PREFIX = PREFIX
    return PREFIX


def _env(stack_id: str) -> dict[str, str]:
    return {
        **os.environ,
        "TOLLGATE_ENV": "test",
        "DATABASE_URL": database_url(),
        "TOLLGATE_REDIS_PREFIX": PREFIX,
        "TOLLGATE_LOG_LEVEL": "WARNING",
        "TOLLGATE_STACK_ID": stack_id,
        "TOLLGATE_MODEL_CACHE_VOLUME": f"{stack_id}-models",
        "TOLLGATE_COMPILE_CACHE_VOLUME": f"{stack_id}-compile",
        "TOLLGATE_PULL_POLICY": "never",
        "TOLLGATE_ENGINE_POLL_SECONDS": "0.2",
        "TOLLGATE_LOGIN_FAILURE_LIMIT": "3",
    }


@pytest.fixture
def live(transactional_db: None, stack: str) -> Iterator[str]:  # noqa: F811
    """The console, admin API and gateway on one port, one worker, like the appliance."""
    port = free_port()
    env = {**_env(stack), "DJANGO_DEBUG": "false"}  # as deployed: the console's own error pages
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "python:config.gunicorn",
            "config.asgi:application",
            "-w",
            "1",
            "-b",
            f"127.0.0.1:{port}",
            "--graceful-timeout",
            "5",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(ROOT / ".pytest-console.log", "w"),
    )
    wait_listening(port, server)
    yield f"http://127.0.0.1:{port}"
    stop(server)


@pytest.fixture
def node_worker(transactional_db: None, stack: str) -> Iterator[Node]:  # noqa: F811
    node = deployment_services.register_node(
        None,
        name="local",
        docker_url=django_settings.TOLLGATE_DOCKER_URL,
        engine_host="127.0.0.1",
        total_memory_bytes=64 * 10**9,
        queue=f"node.{stack}",
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-Q",
            node.queue,
            "--pool",
            "solo",
            "--concurrency",
            "1",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "WARNING",
        ],
        cwd=ROOT,
        env=_env(stack),
        stdout=subprocess.DEVNULL,
        stderr=open(ROOT / ".pytest-console-worker.log", "w"),
    )
    yield node
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(timeout=15)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


@pytest.fixture
def browser(live: str, node_worker: Node, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls
    # are plain synchronous code all the same (set after the subprocesses have started).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SHOTS.mkdir(parents=True, exist_ok=True)
    tolerate_network_changes()
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()
        # Inside sync_playwright() the ORM runs in another context, hence on connections of
        # its own, which pytest-django does not know about: close them here, or they stay
        # open and keep the test database from being dropped.
        connections.close_all()


def shot(page: object, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def login(page: object, url: str, username: str, password: str = PASSWORD) -> None:
    page.goto(f"{url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button:has-text('Log in')")


def test_admin_flow_then_tenant_admin_isolation_lockout_and_csrf(
    live: str,
    node_worker: Node,
    browser: object,
    stack: str,  # noqa: F811
) -> None:
    from django.contrib.auth import get_user_model

    User = get_user_model()
    User.objects.create_user("root", "root@example.test", PASSWORD, is_staff=True)
    # A data migration made them; an earlier test's flush may not have kept them.
    ensure_builtin_profiles()
    model = deployment_services.create_model(
        None,
        served_name="tiny-chat",
        source="Qwen/Qwen3-0.6B",
        params_billions=Decimal("0.6"),
        context_length=4096,
    )
    metering_services.set_price(None, model, Decimal("1.00"), Decimal("0.50"), Decimal("2.00"))

    context = browser.new_context(viewport={"width": 1366, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.goto(f"{live}/login/")
    shot(page, "01-login")
    login(page, live, "root")
    page.wait_for_url(f"{live}/dashboard/")
    shot(page, "02-dashboard-empty")

    # Create a tenant.
    page.goto(f"{live}/tenants/new/")
    page.fill("#id_name", "Acme Research")
    page.fill("#id_quota_amount", "50")
    page.click("button:has-text('Create tenant')")
    page.wait_for_url(f"{live}/tenants/acme-research/")
    assert "Next: issue it an API key" in page.content()

    # Issue a key: shown once, with a copy button.
    page.click("a:has-text('New API key')")
    page.fill("#id_name", "notebook")
    shot(page, "03-key-form")
    page.click("button:has-text('Issue key')")
    secret = page.inner_text("#new-key").strip()
    assert secret.startswith("tg-") and page.is_visible("button[data-copy='new-key']")
    shot(page, "04-key-created")

    # Deploy the model on the simulator engine, with the memory-fit preview first.
    page.goto(f"{live}/deployments/new/")
    page.fill("#id_name", "tiny")
    page.select_option("#id_model", label="tiny-chat")
    page.select_option("#id_node", label="local")
    page.select_option("#id_profile", label="simulator")
    page.fill("#id_image", SIM_IMAGE)
    page.fill("#id_engine_args", "max-num-seqs=4\nmax-model-len=4096")
    page.fill("#id_env", "SIM_LOAD_SECONDS=1.5\nSIM_SHARDS=4\nSIM_TTFT_MS=5\nSIM_DECODE_TPS=0")
    page.dispatch_event("#id_replicas", "change")
    page.wait_for_selector("#fit .fit.ok", timeout=10_000)
    assert "Fits" in page.inner_text("#fit")
    shot(page, "05-deployment-form-fit")
    page.click("button:has-text('Deploy')")
    page.wait_for_url(f"{live}/deployments/tiny/")
    page.wait_for_selector(".steps li.current, .steps li.done", timeout=60_000)
    shot(page, "06-deployment-progress")
    page.wait_for_function(
        "document.querySelector('[data-testid=ready-count]')?.textContent.trim().startsWith('1')",
        timeout=120_000,
    )
    page.wait_for_selector(".steps li.done[data-phase=warmup]", timeout=10_000)
    assert "Ready" in page.inner_text("#live")
    fleet.scrape_all()  # beat's engine scrape, once: running/waiting, KV cache, TTFT into Redis
    page.wait_for_selector("#live td:has-text('%')", timeout=10_000)
    page.click("#live button[title='Replica 0: last 200 lines']")
    page.wait_for_selector("#logs pre", timeout=10_000)
    shot(page, "07-deployment-ready")

    # Requests through the gateway with the key, like any client.
    served = False
    for _ in range(50):
        r = httpx.get(f"{live}/v1/models", headers={"Authorization": f"Bearer {secret}"})
        if r.status_code == 200 and "tiny-chat" in r.text:
            served = True
            break
        page.wait_for_timeout(100)
    assert served
    from openai import OpenAI

    client = OpenAI(base_url=f"{live}/v1", api_key=secret)
    for i in range(3):
        reply = client.chat.completions.create(
            model="tiny-chat", max_tokens=20, messages=[{"role": "user", "content": f"hello {i}"}]
        )
        assert reply.usage.completion_tokens > 0

    # The playground: streamed reply with time to first token, tokens and cost.
    page.goto(f"{live}/playground/?tenant=acme-research")
    page.fill("#pg-input", "Say something nice")
    page.click("#pg-send")
    page.wait_for_selector(".bubble.assistant .meta", timeout=30_000)
    meta = page.inner_text(".bubble.assistant .meta")
    assert "first token" in meta and "completion tokens" in meta and "USD" in meta, meta
    shot(page, "08-playground")

    # Usage lands (the metering consumer's work, run here), then the page and the CSV agree.
    ingest.drain("console-test", 10)
    events = UsageEvent.objects.filter(tenant__slug="acme-research")
    assert events.count() == 4
    expected = events.aggregate(c=Sum("cost"))["c"]
    page.goto(f"{live}/usage/")
    shot(page, "09-usage")
    shown = Decimal(page.get_attribute("[data-total=cost]", "data-raw"))
    assert shown == expected and "4 requests" in page.inner_text("#usage-totals")
    # The vendored Chart.js drew both charts, and the tokens chart adds up to the events' tokens.
    drawn = page.evaluate("""() => ["tokens", "cost"].map((s) => {
        const chart = Chart.getChart(document.getElementById(`usage-chart-${s}`));
        if (!chart) return null;
        return chart.data.datasets.flatMap((d) => d.data).reduce((a, b) => a + (b || 0), 0);
    })""")
    tokens = events.aggregate(t=Sum(F("prompt_tokens") + F("completion_tokens")))["t"]
    assert drawn[0] == tokens and drawn[1] is not None and drawn[1] > 0, (drawn, tokens)
    with page.expect_download() as download_info:
        page.click("a:has-text('Download CSV (showback)')")
    rows = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert sum(Decimal(r["cost"]) for r in rows) == expected
    assert sum(int(r["requests"]) for r in rows) == 4

    page.goto(f"{live}/dashboard/")
    page.wait_for_selector("text=Acme Research")
    shot(page, "10-dashboard")
    for path, name in (
        ("/tenants/", "11-tenants"),
        ("/tenants/acme-research/", "12-tenant-detail"),
        ("/keys/", "13-keys"),
        ("/models/", "14-models"),
        (f"/models/{model.pk}/", "15-model-detail"),
        ("/nodes/", "16-nodes"),
        ("/deployments/", "17-deployments"),
        ("/audit/", "18-audit"),
    ):
        response = page.goto(f"{live}{path}")
        assert response.status == 200, path
        shot(page, name)

    # A form posted without its CSRF token is refused.
    refused = context.request.post(f"{live}/tenants/new/", form={"name": "No token"})
    assert refused.status == 403 and "security token" in refused.text()
    page.click("button:has-text('Log out')")
    page.wait_for_url(f"{live}/login/")

    # A tenant admin sees only their tenant.
    acme = tenants_of(User.objects.get(username="root")).get(slug="acme-research")
    other = tenant_services.create_tenant(None, name="Other Corp", slug="other")
    tenant_services.issue_api_key(None, other, name="other-key")
    alice = User.objects.create_user("alice", "alice@example.test", PASSWORD)
    tenant_services.add_member(None, acme, alice, Role.ADMIN)
    login(page, live, "alice")
    page.wait_for_url(f"{live}/tenants/acme-research/")
    text = page.inner_text("body")
    assert "Acme Research" in text and "Other Corp" not in text and "Dashboard" not in text
    shot(page, "19-tenant-admin-home")
    page.goto(f"{live}/keys/")
    assert "notebook" in page.inner_text("body") and "other-key" not in page.inner_text("body")
    response = page.goto(f"{live}/tenants/other/")
    assert response.status == 404 and "Not found (404)" in page.inner_text("body")
    shot(page, "20-other-tenant-404")
    assert page.goto(f"{live}/dashboard/").status == 403
    shot(page, "21-forbidden-403")
    context.close()

    # A wrong password repeated locks the account out (limit 3 in this server's settings).
    User.objects.create_user("victim", "victim@example.test", PASSWORD)
    fresh = browser.new_context()
    page = fresh.new_page()
    for _ in range(3):
        login(page, live, "victim", "not the password")
    assert "Too many failed logins" in page.inner_text("body")
    login(page, live, "victim")  # the right password is refused while locked out
    assert "Too many failed logins" in page.inner_text("body")
    shot(page, "22-locked-out")
    fresh.close()
