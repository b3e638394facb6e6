"""Uploading an adapter's files in the console: the add and edit forms take a .tar, .tar.gz or
.zip; a refused archive is a form error naming why; the files are kept for the worker and
go with the adapter. Tenant B's admin cannot reach tenant A's adapter's form (404); a member
cannot change it (403)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from deployments import adapters as adapter_services
from deployments.adapter_files import UPLOADS
from deployments.choices import AdapterStatus
from deployments.models import Adapter, CatalogModel
from tenants.models import Tenant
from tests.deployments.test_adapter_archives import GOOD, make_tar, make_zip

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def uploads(settings: Any, tmp_path: Path) -> Path:
    settings.TOLLGATE_UPLOAD_DIR = str(tmp_path)
    return tmp_path


def kept(uploads: Path) -> list[str]:
    folder = uploads / "adapters"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def u(name: str, *args: object) -> str:
    return reverse(f"console:{name}", args=args)


def upload(data: bytes, name: str = "support.tar.gz") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/gzip")


def form(base: CatalogModel, **overrides: object) -> dict[str, object]:
    return {"served_name": "acme/support", "base": base.pk, "source": "", **overrides}


def test_a_tenant_admin_adds_an_adapter_by_uploading_its_files(
    web: Any,
    alice: Any,
    public_model: CatalogModel,
    uploads: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = web(alice)
    page = client.get(u("adapter-new")).content.decode()
    assert 'enctype="multipart/form-data"' in page and 'type="file" name="archive"' in page
    added = client.post(
        u("adapter-new"), form(public_model, archive=upload(make_tar(GOOD, compress=True)))
    )
    adapter = Adapter.objects.get(served_name="acme/support")
    assert added.status_code == 302, added.content.decode()[:2000]
    assert adapter.source.startswith(f"{UPLOADS}/acme--support-")
    assert adapter.status == AdapterStatus.CHECKING and adapter.tenant.slug == "acme"
    assert kept(uploads) == [adapter.source.rsplit("/", 1)[1] + ".tar"]
    detail = client.get(added["Location"]).content.decode()
    assert "tollgate-adapters/acme--support-" in detail

    # Editing: new files replace the old ones, which go once saved.
    with django_capture_on_commit_callbacks(execute=True):
        edited = client.post(
            u("adapter-edit", adapter.pk),
            form(public_model, source=adapter.source, archive=upload(make_zip(GOOD), "a.zip")),
        )
    assert edited.status_code == 302
    old, adapter = adapter.source, Adapter.objects.get(pk=adapter.pk)
    assert adapter.source != old and kept(uploads) == [adapter.source.rsplit("/", 1)[1] + ".tar"]
    with django_capture_on_commit_callbacks(execute=True):
        deleted = client.post(u("adapter-delete", adapter.pk))
    assert deleted.status_code == 302 and kept(uploads) == []


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (make_tar(GOOD, link="symlink"), "links, devices, pipes and other special files"),
        (make_zip({**GOOD, "/etc/passwd": b"x"}), "absolute paths are not allowed"),
        (make_tar({**GOOD, "../up.safetensors": b"x"}), "must not climb out of the archive"),
        (make_zip({**GOOD, "pytorch_model.bin": b"x"}), "pytorch_model.bin: only"),
        (make_tar({k: v for k, v in GOOD.items() if k != "adapter_config.json"}), "No adapter_"),
    ],
)
def test_a_refused_archive_is_a_form_error_naming_why(
    web: Any, alice: Any, public_model: CatalogModel, uploads: Path, data: bytes, words: str
) -> None:
    refused = web(alice).post(u("adapter-new"), form(public_model, archive=upload(data)))
    page = refused.content.decode()
    assert refused.status_code == 400 and words in page.replace("&#x27;", "'")
    assert 'value="acme/support"' in page  # what was typed stays
    assert not Adapter.objects.exists() and kept(uploads) == []


def test_the_form_wants_a_source_or_files(
    web: Any, alice: Any, public_model: CatalogModel, uploads: Path
) -> None:
    client = web(alice)
    neither = client.post(u("adapter-new"), form(public_model))
    assert neither.status_code == 400
    assert "or upload the files" in neither.content.decode()
    both = client.post(
        u("adapter-new"), form(public_model, source="acme/x-lora", archive=upload(make_tar(GOOD)))
    )
    assert both.status_code == 400 and not Adapter.objects.exists() and kept(uploads) == []


def test_an_upload_too_large_for_any_adapter_is_refused_before_it_is_read(
    web: Any, alice: Any, public_model: CatalogModel, settings: Any, uploads: Path
) -> None:
    settings.TOLLGATE_ADAPTER_MAX_BYTES = 1000
    big = make_tar({**GOOD, "adapter_model.safetensors": b"\0" * 3_000_000})
    client = web(alice)
    refused = client.post(u("adapter-new"), form(public_model, archive=upload(big)), follow=True)
    assert "an adapter may take at most 0.00 GB" in refused.content.decode()
    assert not Adapter.objects.exists() and kept(uploads) == []


def test_an_upload_past_the_limit_inside_its_length_is_cut_off_and_said_so(
    web: Any, alice: Any, public_model: CatalogModel, settings: Any, uploads: Path
) -> None:
    """A body within the allowance for the form's fields, whose file alone is too large:
    the file is dropped while it is read, and the form says why."""
    settings.TOLLGATE_ADAPTER_MAX_BYTES = 100_000
    big = make_tar({**GOOD, "adapter_model.safetensors": b"\0" * 300_000})
    client = web(alice)
    refused = client.post(u("adapter-new"), form(public_model, archive=upload(big)), follow=True)
    page = refused.content.decode()
    assert "The archive is larger than the 0.00 GB an adapter may take" in page
    assert not Adapter.objects.exists() and kept(uploads) == []


def test_only_the_adapters_own_admins_upload_its_files(
    web: Any,
    alice: Any,
    bob: Any,
    carol: Any,
    tenant_a: Tenant,
    public_model: CatalogModel,
    uploads: Path,
) -> None:
    adapter = adapter_services.create_adapter(
        alice, served_name="acme/support", base=public_model, tenant=tenant_a, source="acme/s"
    )
    for user, status in ((carol, 404), (bob, 403)):
        answer = web(user).post(
            u("adapter-edit", adapter.pk),
            form(public_model, source="acme/s", archive=upload(make_tar(GOOD))),
        )
        assert answer.status_code == status
    assert Adapter.objects.get(pk=adapter.pk).source == "acme/s" and kept(uploads) == []
