"""A tenant admin's LoRA adapter in Debian's Chromium, at desktop and phone widths, end to end.

The live server, the node's Celery worker and the simulator engine in Docker are those of
tests/console/test_browser.py. The base model runs with adapters enabled; the adapter's
files are staged in the stack's model cache volume, where the worker's check (a helper
container of the engine image) reads them. Screenshots go to tests/console/screenshots/.
"""

import io
import json
import tarfile
import time
from collections.abc import Callable
from decimal import Decimal

import docker
import pytest
from django.contrib.auth import get_user_model
from django.db.models import Sum

from deployments import adapters as adapter_services
from deployments import services as deployment_services
from deployments.choices import AdapterStatus, ReplicaState
from deployments.models import Adapter, CatalogModel, Node, Replica
from metering import ingest
from metering import services as metering_services
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import Tenant
from tests import leaks
from tests.conftest import PASSWORD
from tests.console.test_browser import (  # noqa: F401 - fixtures
    SHOTS,
    browser,
    live,
    login,
    node_worker,
    redis_namespace,
)
from tests.console.test_people_browser import OVERFLOWING_CELLS
from tests.deployments.conftest import SIM_IMAGE, stack  # noqa: F401 - fixture

pytestmark = [pytest.mark.browser, pytest.mark.docker, pytest.mark.django_db(transaction=True)]

REPO = "acme/support-lora"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def adapter_loads_on_the_node(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The gateway asks the node's worker (the only one here) to load adapters, as a one-box
    appliance may (the default is the control plane's queue). Set before the live server
    and the worker start: they take this environment."""
    monkeypatch.setenv("TOLLGATE_DEMAND_QUEUE", f"node.{stack}")


def wait_for(check: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def stage_adapter(volume: str) -> None:
    """Put a LoRA adapter (rank 8, safetensors) into the model cache volume in the hub
    cache's layout, as `hf download acme/support-lora` would."""
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    header = json.dumps({"x.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    weights = len(header).to_bytes(8, "little") + header.encode() + b"\0" * 4
    root = f"hub/models--{REPO.replace('/', '--')}"
    files = {
        f"{root}/refs/main": SNAPSHOT.encode(),
        f"{root}/snapshots/{SNAPSHOT}/adapter_config.json": json.dumps(config).encode(),
        f"{root}/snapshots/{SNAPSHOT}/adapter_model.safetensors": weights,
    }
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    client = docker.from_env()
    helper = client.containers.create(
        SIM_IMAGE,
        entrypoint=["true"],
        name=leaks.unique_name("tgtest-stage"),
        labels={"tollgate.test": leaks.RUN},
        volumes={volume: {"bind": "/cache", "mode": "rw"}},
    )
    try:
        assert helper.put_archive("/cache", archive.getvalue())
    finally:
        helper.remove(v=True, force=True)


def serve_base_with_adapters(node: Node) -> object:
    """The base model on the simulator with adapters enabled (one slot), ready."""
    model = deployment_services.create_model(
        None,
        served_name="tiny-chat",
        source="Qwen/Qwen3-0.6B",
        params_billions=Decimal("0.6"),
        context_length=4096,
    )
    metering_services.set_price(None, model, Decimal("1.00"), Decimal("0.50"), Decimal("2.00"))
    deployment_services.create_deployment(
        None,
        name="tiny",
        model=model,
        node=node,
        image=SIM_IMAGE,
        engine_args={"max-num-seqs": 4, "max-model-len": 4096, "enable-lora": True},
        env={"SIM_LOAD_SECONDS": "0.5", "SIM_SHARDS": "4", "SIM_TTFT_MS": "5"},
    )
    wait_for(
        lambda: Replica.objects.filter(deployment__name="tiny", state=ReplicaState.READY).first(),
        120,
        "the simulator engine to be ready",
    )
    return model


def tenants_with_admins() -> Tenant:
    """Acme (admin alice) and Bravo (admin carol); Acme."""
    User = get_user_model()
    acme = tenant_services.create_tenant(None, name="Acme Research", slug="acme")
    bravo = tenant_services.create_tenant(None, name="Bravo Labs", slug="bravo")
    for name, tenant in (("alice", acme), ("carol", bravo)):
        user = User.objects.create_user(name, f"{name}@example.test", PASSWORD)
        tenant_services.add_member(None, tenant, user, Role.ADMIN)
    return acme


def alice_page(browser: object, live: str, width: int) -> object:
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    login(page, live, "alice")
    page.wait_for_url(f"{live}/tenants/acme/")
    return page


def test_tenant_admin_adds_an_adapter_and_sees_it_checked(
    live: str,  # noqa: F811
    node_worker: Node,  # noqa: F811
    browser: object,  # noqa: F811
    stack: str,  # noqa: F811
) -> None:
    tenants_with_admins()
    serve_base_with_adapters(node_worker)
    stage_adapter(f"{stack}-models")

    pages = {}
    for width in (1280, 375):
        name = f"acme/support-{width}"
        page = alice_page(browser, live, width)
        page.click("nav.mainnav >> text=Adapters")
        page.wait_for_url(f"{live}/adapters/")
        page.click("a:has-text('Add adapter')")

        # A served name outside Acme's space: said on the form, nothing typed is lost.
        page.fill("#id_served_name", "tiny-chat")
        page.select_option("#id_base", label="tiny-chat")
        page.fill("#id_source", REPO)
        page.click("button:has-text('Add adapter')")
        space = "Name Acme Research's adapters acme/<name>, e.g. acme/support-v3."
        assert space in page.inner_text("main form.form")
        assert page.input_value("#id_source") == REPO
        page.screenshot(path=str(SHOTS / f"adapters-01-form-error-{width}.png"), full_page=True)

        page.fill("#id_served_name", name)
        page.fill("#id_description", "Answers like our support desk.")
        page.click("button:has-text('Add adapter')")
        page.wait_for_url(f"{live}/adapters/*/")
        pages[width] = page.url
        # The node's worker checks the files in a helper container; the page follows it.
        page.wait_for_selector("#adapter-status .badge:has-text('Ready')", timeout=90_000)
        props = page.inner_text("#adapter-props")
        assert "Rank\n8" in props and "q_proj" in props and "Acme Research" in props, props
        assert "the base's price" in page.inner_text("#adapter-price")
        assert page.evaluate(OVERFLOWING_CELLS) == []
        page.screenshot(path=str(SHOTS / f"adapters-02-ready-{width}.png"), full_page=True)
        page.goto(f"{live}/adapters/")
        assert name in page.inner_text("main") and page.evaluate(OVERFLOWING_CELLS) == []
        page.screenshot(path=str(SHOTS / f"adapters-03-list-{width}.png"), full_page=True)
        page.context.close()
    adapter = Adapter.objects.get(served_name="acme/support-375")
    assert adapter.status == AdapterStatus.READY and adapter.rank == 8

    # Tenant B's admin: the adapter does not exist for them, on any page.
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    login(page, live, "carol")
    page.wait_for_url(f"{live}/tenants/bravo/")
    response = page.goto(pages[1280])
    assert response.status == 404 and "Not found (404)" in page.inner_text("body")
    page.goto(f"{live}/adapters/")
    assert "acme/support" not in page.inner_text("main")
    page.goto(f"{live}/playground/?tenant=bravo")
    assert "acme/support" not in page.inner_text("#pg-model")
    context.close()


def test_tenant_admin_uses_the_adapter_in_the_playground_sees_it_loaded_and_billed(
    live: str,  # noqa: F811
    node_worker: Node,  # noqa: F811
    browser: object,  # noqa: F811
    stack: str,  # noqa: F811
) -> None:
    acme = tenants_with_admins()
    serve_base_with_adapters(node_worker)
    stage_adapter(f"{stack}-models")
    for width in (1280, 375):
        adapter_services.create_adapter(
            None,
            served_name=f"acme/support-{width}",
            base=CatalogModel.objects.get(served_name="tiny-chat"),
            tenant=acme,
            source=REPO,
        )
    wait_for(
        lambda: Adapter.objects.filter(status=AdapterStatus.READY).count() == 2,
        90,
        "the worker to check both adapters",
    )

    # Alice chats with it in the playground (through the gateway, which has the node's
    # worker load it into the engine), sees the replica holding it, then its usage.
    for width in (1280, 375):
        name = f"acme/support-{width}"
        page = alice_page(browser, live, width)
        page.goto(f"{live}/adapters/")
        page.click(f"a:has-text('{name}')")
        page.click("#adapter-try")
        page.wait_for_url(f"{live}/playground/*")
        assert page.input_value("#pg-model") == name
        page.fill("#pg-input", "Say something nice")
        page.click("#pg-send")
        page.wait_for_selector(".bubble.assistant .meta", timeout=90_000)
        meta = page.inner_text(".bubble.assistant .meta")
        page.screenshot(path=str(SHOTS / f"adapters-04-playground-{width}.png"), full_page=True)
        assert "completion tokens" in meta and "USD" in meta, meta
        page.go_back()
        page.wait_for_selector("#adapter-replicas td:has-text('tiny')", timeout=30_000)
        assert "#0" in page.inner_text("#adapter-replicas")
        page.screenshot(path=str(SHOTS / f"adapters-05-loaded-{width}.png"), full_page=True)

        ingest.drain("console-adapters", 10)
        events = UsageEvent.objects.filter(adapter__served_name=name)
        assert events.count() == 1
        page.click("#adapter-usage")
        page.wait_for_url(f"{live}/usage/?adapter=*")
        assert "1 request" in page.inner_text("#usage-totals")
        cost = events.aggregate(c=Sum("cost"))["c"]
        assert cost > 0 and Decimal(page.get_attribute("[data-total=cost]", "data-raw")) == cost
        page.screenshot(path=str(SHOTS / f"adapters-06-usage-{width}.png"), full_page=True)
        page.context.close()
