"""Adapters whose files are uploaded (the admin API's ``archive``, the console's file field).

The web process checks the archive before accepting it (``adapter_archives``) and keeps it,
normalised, as a tar in TOLLGATE_UPLOAD_DIR; the adapter's source becomes a folder of
Tollgate's own in the model cache, ``tollgate-adapters/<folder>``, which each node's check
fills from that tar first (``adapter_files``). Replacing the files makes a new folder, so a
node's copy is never half old, half new; the old tar goes once the change commits, and an
adapter's tar goes with it.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import UploadedFile

from core.uploads import FORM_SLACK_BYTES, refused_upload
from deployments import adapter_archives, adapter_files, adapters
from deployments.models import Adapter
from tenants.audit import Actor


def check_request_size(content_length: str | int | None) -> None:
    """Refuse an upload too large for any adapter before its body is parsed."""
    try:
        length = int(content_length or 0)
    except ValueError:
        return
    adapter_archives.check_packed_size(max(0, length - FORM_SLACK_BYTES))


def check_not_cut_off(request: Any) -> None:
    """Refuse a body whose archive was dropped while it was read (core/uploads.py): a
    chunked upload past the limit has no Content-Length to refuse it by beforehand."""
    refused = refused_upload(request)
    if refused is not None:
        raise ValidationError(
            {
                "archive": f"The archive is larger than the {adapter_archives.gb(refused.limit)} "
                f"an adapter may take ({refused.setting})."
            }
        )


def accept_upload(archive: UploadedFile, served_name: str) -> str:
    """Check the archive and keep it for the worker; the source the adapter gets."""
    folder = adapter_files.new_folder(served_name)
    adapter_archives.accept(archive, archive.size, folder, adapter_files.archive_path(folder))
    return f"{adapter_files.UPLOADS}/{folder}"


def create_uploaded_adapter(actor: Actor, archive: UploadedFile, **fields: Any) -> Adapter:
    """Register an adapter with the files of an uploaded archive (checked before anything)."""
    if fields.get("source"):
        raise ValidationError({"archive": "Give either a source or an archive, not both."})
    fields.pop("source", None)
    source = accept_upload(archive, str(fields.get("served_name") or ""))
    try:
        return adapters.create_adapter(actor, **fields, source=source)
    except Exception:
        adapter_files.remove_upload(source)
        raise


def replace_adapter_files(actor: Actor, adapter: Adapter, archive: UploadedFile) -> Adapter:
    """Give an adapter the files of a new archive; they are checked again on every node."""
    source = accept_upload(archive, adapter.served_name)
    try:
        return adapters.update_adapter(actor, adapter, source=source)
    except Exception:
        adapter_files.remove_upload(source)
        raise
