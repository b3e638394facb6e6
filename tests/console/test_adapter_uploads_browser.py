"""A tenant admin uploads a LoRA adapter's files in Debian's Chromium, end to end: the web
process checks and keeps the archive, the node's Celery worker copies it into the stack's
model cache volume through the Docker API policy and checks it there, and the page shows it
ready. A refused archive is a form error. Screenshots go to tests/console/screenshots/."""

from pathlib import Path

import pytest

from deployments.adapter_files import UPLOADS
from deployments.choices import AdapterStatus
from deployments.models import Adapter, Node
from tests.console.test_adapters_browser import (
    alice_page,
    serve_base_with_adapters,
    tenants_with_admins,
)
from tests.console.test_browser import (  # noqa: F401 - fixtures
    SHOTS,
    browser,
    live,
    node_worker,
    redis_namespace,
)
from tests.deployments.conftest import stack  # noqa: F401 - fixture
from tests.deployments.test_adapter_archives import GOOD, make_tar

pytestmark = [pytest.mark.browser, pytest.mark.docker, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def shared_uploads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The web process and the node's worker share one upload folder, as the appliance's
    adapter-uploads volume. Set before they start: they take this environment."""
    folder = tmp_path / "uploads"
    monkeypatch.setenv("TOLLGATE_UPLOAD_DIR", str(folder))
    return folder


def test_tenant_admin_uploads_an_adapter_and_sees_it_copied_and_checked(
    live: str,  # noqa: F811
    node_worker: Node,  # noqa: F811
    browser: object,  # noqa: F811
    tmp_path: Path,
    shared_uploads: Path,
) -> None:
    tenants_with_admins()
    serve_base_with_adapters(node_worker)
    good, bad = tmp_path / "support-v3.tar.gz", tmp_path / "pickled.tar"
    good.write_bytes(make_tar({f"support-v3/{n}": d for n, d in GOOD.items()}, compress=True))
    bad.write_bytes(make_tar({**GOOD, "adapter_model.bin": b"pickle"}))

    page = alice_page(browser, live, 1280)
    page.goto(f"{live}/adapters/new/")
    page.fill("#id_served_name", "acme/support-v3")
    page.select_option("#id_base", label="tiny-chat")
    page.set_input_files("#id_archive", str(bad))
    page.click("button:has-text('Add adapter')")
    errors = page.inner_text("main form.form")
    assert "adapter_model.bin: only adapter_config.json, *.safetensors weights" in errors
    assert page.input_value("#id_served_name") == "acme/support-v3"
    page.screenshot(path=str(SHOTS / "adapters-upload-01-refused.png"), full_page=True)

    page.set_input_files("#id_archive", str(good))
    page.click("button:has-text('Add adapter')")
    page.wait_for_url(f"{live}/adapters/*/")
    # The node's worker copies the files into its model cache, then checks them there.
    page.wait_for_selector("#adapter-status .badge:has-text('Ready')", timeout=90_000)
    props = page.inner_text("#adapter-props")
    assert "Rank\n8" in props and "q_proj" in props, props
    page.screenshot(path=str(SHOTS / "adapters-upload-02-ready.png"), full_page=True)
    adapter = Adapter.objects.get(served_name="acme/support-v3")
    assert adapter.status == AdapterStatus.READY and adapter.source.startswith(UPLOADS)
    assert [p.name for p in (shared_uploads / "adapters").iterdir()] == [
        adapter.source.rsplit("/", 1)[1] + ".tar"
    ]
    page.context.close()
