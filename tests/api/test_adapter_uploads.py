"""Adapters whose files are uploaded through the admin API: ``archive`` on create (multipart)
and the ``upload`` action. The archive is checked before it is accepted (each refusal is a
400 naming the reason), kept for the worker, and gone with the adapter; tenant B can neither
replace nor learn of tenant A's files (404), a member cannot replace them (403)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from deployments.adapter_files import UPLOADS
from deployments.choices import AdapterStatus
from deployments.models import Adapter
from tenants.models import AuditLog
from tests.api.conftest import World
from tests.deployments.test_adapter_archives import GOOD, make_tar, make_zip

LIST = "/api/v1/adapters/"
SUPPORT = "/api/v1/adapters/acme/support-v3/"


@pytest.fixture(autouse=True)
def uploads(settings: Any, tmp_path: Path) -> Path:
    settings.TOLLGATE_UPLOAD_DIR = str(tmp_path)
    return tmp_path


def kept(uploads: Path) -> list[str]:
    """The archives Tollgate keeps for the worker."""
    folder = uploads / "adapters"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def archive(data: bytes, name: str = "legal.tar.gz") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")


def fields(**more: Any) -> dict[str, Any]:
    return {"served_name": "acme/legal-v1", "base": "qwen3-8b", **more}


def reason(response: Any) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


def test_a_tenant_admin_registers_an_adapter_by_uploading_its_files(
    world: World,
    client_for: Callable[..., APIClient],
    uploads: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    alice = client_for(world.alice)
    files = make_tar(GOOD, compress=True)
    created = alice.post(LIST, fields(archive=archive(files)), format="multipart")
    assert created.status_code == 201, created.content
    answer = created.json()
    assert answer["tenant"] == "acme" and answer["status"] == "checking"
    assert "archive" not in answer
    folder = answer["source"].removeprefix(f"{UPLOADS}/")
    assert answer["source"].startswith(f"{UPLOADS}/acme--legal-v1-") and "/" not in folder
    assert kept(uploads) == [f"{folder}.tar"]
    audit = AuditLog.objects.get(
        object_type="adapter", action="create", object_repr="acme/legal-v1"
    )
    assert audit.actor == world.alice and audit.changes["source"] == answer["source"]
    # Bob (a member) reads it; carol (tenant B) does not know it exists.
    assert client_for(world.bob).get("/api/v1/adapters/acme/legal-v1/").status_code == 200
    assert client_for(world.carol).get("/api/v1/adapters/acme/legal-v1/").status_code == 404

    with django_capture_on_commit_callbacks(execute=True):
        assert alice.delete("/api/v1/adapters/acme/legal-v1/").status_code == 204
    assert kept(uploads) == []  # the archive goes with the adapter


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (make_tar(GOOD, evil="symlink"), "archive", "links, devices, pipes"),
        (make_zip({**GOOD, "../../x.safetensors": b"x"}), "archive", "must not climb out"),
        (make_zip({**GOOD, "model.bin": b"x"}), "archive", "model.bin: only"),
        (make_tar({**GOOD, "adapter_config.json": b'{"peft_type": "LORA"}'}), "archive", "rank"),
        (b"%PDF-1.7 not an archive" * 40, "archive", "Upload a .tar, .tar.gz or .zip"),
    ],
)
def test_an_unsafe_or_wrong_archive_is_a_400_with_its_reason_and_nothing_is_kept(
    world: World,
    client_for: Callable[..., APIClient],
    uploads: Path,
    data: bytes,
    field: str,
    words: str,
) -> None:
    refused = client_for(world.alice).post(LIST, fields(archive=archive(data)), format="multipart")
    assert refused.status_code == 400, refused.content
    assert words in reason(refused)[field]
    assert kept(uploads) == [] and not Adapter.objects.filter(served_name="acme/legal-v1").exists()


def test_a_source_or_an_archive_not_both_nor_neither(
    world: World, client_for: Callable[..., APIClient], uploads: Path
) -> None:
    alice = client_for(world.alice)
    both = fields(source="acme/legal-v1-lora", archive=archive(make_tar(GOOD)))
    for body in (both, fields()):
        refused = alice.post(LIST, body, format="multipart")
        assert refused.status_code == 400
        assert "either a source" in reason(refused)["source"]
    patched = alice.patch(SUPPORT, {"archive": archive(make_tar(GOOD))}, format="multipart")
    assert patched.status_code == 400 and "upload action" in reason(patched)["archive"]
    assert kept(uploads) == []


def test_an_upload_larger_than_the_limit_is_refused_before_it_is_read(
    world: World, client_for: Callable[..., APIClient], settings: Any, uploads: Path
) -> None:
    settings.TOLLGATE_ADAPTER_MAX_BYTES = 1000
    big = make_tar({**GOOD, "adapter_model.safetensors": b"\0" * 3_000_000})
    refused = client_for(world.alice).post(LIST, fields(archive=archive(big)), format="multipart")
    assert refused.status_code == 400
    assert "an adapter may take at most 0.00 GB (TOLLGATE_ADAPTER_MAX_BYTES)" in str(refused.json())
    assert kept(uploads) == []


def test_an_archive_past_the_limit_inside_its_length_is_cut_off_and_refused_in_its_terms(
    world: World, client_for: Callable[..., APIClient], settings: Any, uploads: Path
) -> None:
    """The body's length leaves room for the form's fields, the archive alone is too
    large: it is dropped while read, and the 400 names the archive, not a missing file."""
    settings.TOLLGATE_ADAPTER_MAX_BYTES = 100_000
    big = make_tar({**GOOD, "adapter_model.safetensors": b"\0" * 300_000})
    refused = client_for(world.alice).post(LIST, fields(archive=archive(big)), format="multipart")
    assert refused.status_code == 400, refused.content
    assert reason(refused) == {
        "archive": "The archive is larger than the 0.00 GB an adapter may take "
        "(TOLLGATE_ADAPTER_MAX_BYTES)."
    }
    assert not Adapter.objects.filter(served_name="acme/legal-v1").exists()
    assert kept(uploads) == []


def test_a_tenant_admin_replaces_her_adapters_files_and_the_old_ones_go(
    world: World,
    client_for: Callable[..., APIClient],
    uploads: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    alice = client_for(world.alice)
    first = alice.post(LIST, fields(archive=archive(make_tar(GOOD))), format="multipart")
    assert first.status_code == 201
    with django_capture_on_commit_callbacks(execute=True):
        replaced = alice.post(
            "/api/v1/adapters/acme/legal-v1/upload/",
            {"archive": archive(make_zip(GOOD), "legal.zip")},
            format="multipart",
        )
    assert replaced.status_code == 202, replaced.content
    answer = replaced.json()
    assert answer["source"] != first.json()["source"] and answer["status"] == "checking"
    assert kept(uploads) == [answer["source"].removeprefix(f"{UPLOADS}/") + ".tar"]
    update = AuditLog.objects.get(
        object_type="adapter", action="update", object_repr="acme/legal-v1"
    )
    assert update.actor == world.alice and set(update.changes) == {"source"}
    # An upload to an adapter given by hub id makes it an uploaded one.
    moved = alice.post(
        f"{SUPPORT}upload/", {"archive": archive(make_tar(GOOD))}, format="multipart"
    )
    assert moved.status_code == 202 and moved.json()["source"].startswith(UPLOADS)
    assert len(kept(uploads)) == 2


def test_only_the_adapters_own_admins_replace_its_files(
    world: World, client_for: Callable[..., APIClient], uploads: Path
) -> None:
    files = {"archive": archive(make_tar(GOOD))}
    carol = client_for(world.carol).post(f"{SUPPORT}upload/", files, format="multipart")
    assert carol.status_code == 404
    bob = client_for(world.bob).post(
        f"{SUPPORT}upload/", {"archive": archive(make_tar(GOOD))}, format="multipart"
    )
    assert bob.status_code == 403
    assert kept(uploads) == []
    adapter = Adapter.objects.get(served_name="acme/support-v3")
    assert adapter.source == "acme/support-v3-lora" and adapter.status == AdapterStatus.CHECKING


def test_an_upload_folder_cannot_be_taken_as_a_source_by_hand(
    world: World, client_for: Callable[..., APIClient], uploads: Path
) -> None:
    """Tenant B cannot name tenant A's uploaded files (or any upload) as its adapter's source."""
    alice = client_for(world.alice)
    mine = alice.post(LIST, fields(archive=archive(make_tar(GOOD))), format="multipart")
    theirs = mine.json()["source"]
    carol = client_for(world.carol)
    for source in (theirs, f"{UPLOADS}/bravo--x-0123456789ab", UPLOADS):
        refused = carol.post(
            LIST,
            {"served_name": "bravo/stolen", "base": "qwen3-8b", "source": source},
            format="json",
        )
        assert refused.status_code == 400
        assert "Tollgate's copies of uploads" in reason(refused)["source"]
    root = client_for(world.root).patch(SUPPORT, {"source": theirs}, format="json")
    assert root.status_code == 400  # not even a platform admin points two adapters at one
    # Keeping its own upload as the source while changing something else is fine.
    kept_source = alice.patch(
        "/api/v1/adapters/acme/legal-v1/",
        {"source": theirs, "description": "Contracts."},
        format="json",
    )
    assert kept_source.status_code == 200, kept_source.content
