"""Where an adapter's files come from, and how the worker puts them on a node before its check.

Three kinds of source:

- a folder in the model cache (``/root/.cache/huggingface/…``): the admin put the files
  there on every node, as for a model given by path; Tollgate only checks them;
- a hub id (``org/name``): staged like a model's weights, on each node that serves the base
  with adapters, when its check finds it missing from that node's cache (the Hugging Face
  CLI in a helper of the engine image: TOLLGATE_STAGE_ENTRYPOINT, HF_TOKEN, its progress);
- an uploaded archive: the web process keeps it, checked and normalised, as a tar in
  TOLLGATE_UPLOAD_DIR, and the adapter's source is a folder of Tollgate's own in the cache
  (``tollgate-adapters/<folder>``); the worker copies the tar into each node's cache through
  Docker's archive API into a helper that is created and never started (on a joined node
  the tar streams through its agent: deployments/relay.py).
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

from django.conf import settings
from docker import DockerClient

from deployments import progress, runtime
from deployments.models import Adapter, Operation
from deployments.operations import EngineFailed, update_op

CACHE = runtime.MODEL_CACHE
UPLOADS = f"{CACHE}/tollgate-adapters"  # dockerpolicy allows archives into this folder only
_FOLDER = re.compile(r"[A-Za-z0-9._-]{1,160}", re.ASCII)


class FetchFailed(EngineFailed):
    """The adapter's files could not be put on a node; the message says why, for its row."""

    def summary(self) -> str:
        """The reason with the helper's last words (what an admin fixes)."""
        last = [line.strip() for line in self.log_tail.splitlines() if line.strip()]
        return f"{self}: {last[-1][:300]}" if last else str(self)


def is_hub(source: str) -> bool:
    return not source.startswith("/")


def upload_folder(source: str) -> str | None:
    """The folder name of an uploaded adapter's source, else None."""
    parent, _, name = source.rpartition("/")
    return name if parent == UPLOADS and _FOLDER.fullmatch(name) else None


def in_uploads(source: str) -> bool:
    """Whether a source points into Tollgate's own folder of uploads (anywhere in it)."""
    return source.rstrip("/") == UPLOADS or source.startswith(f"{UPLOADS}/")


def fetchable(source: str) -> bool:
    """Whether Tollgate puts the files on nodes itself (a hub id or an upload)."""
    return is_hub(source) or upload_folder(source) is not None


def new_folder(served_name: str) -> str:
    """A fresh folder name for an upload: readable, and never one in use or used before."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "--", served_name)[:100].strip(".-") or "adapter"
    return f"{readable}-{secrets.token_hex(6)}"


def archive_path(folder: str) -> Path:
    """Where the web process keeps an upload's normalised tar (shared with the worker)."""
    return Path(settings.TOLLGATE_UPLOAD_DIR) / "adapters" / f"{folder}.tar"


def upload_archive(source: str) -> Path | None:
    folder = upload_folder(source)
    return archive_path(folder) if folder else None


def remove_upload(source: str) -> None:
    """Delete an upload's tar (the copies in nodes' caches stay until an admin clears them)."""
    path = upload_archive(source)
    if path is not None:
        path.unlink(missing_ok=True)


def not_found(report: dict) -> bool:
    """Whether an inspection found no files at the source on that node."""
    return str(report.get("error") or "").startswith("No adapter found at")


# --- On the node (the worker) ---------------------------------------------------------------


def fetch(op: Operation, dc: DockerClient, adapter: Adapter, labels: dict[str, str]) -> None:
    """Put the adapter's files into this node's model cache: download a hub id, copy an
    upload. Raises FetchFailed (or the runtime's failure) with the reason."""
    if upload_folder(adapter.source):
        copy_upload(op, dc, adapter, labels)
    else:
        download(op, dc, adapter.source, labels)


def download(op: Operation, dc: DockerClient, source: str, labels: dict[str, str]) -> None:
    """``hf download <source>`` in a helper of the engine image, as weights are staged."""
    node = op.node.name
    env = {"HF_TOKEN": settings.HF_TOKEN} if settings.HF_TOKEN else {}
    update_op(op, phase="download", progress=0.0, message=f"downloading {source} on {node}")
    helper = runtime.run_to_completion(
        dc,
        op.detail["image"],
        settings.TOLLGATE_STAGE_ENTRYPOINT,
        [source],
        env,
        labels,
        name=f"{settings.TOLLGATE_STACK_ID}-adapter-download-{op.pk}",
    )
    try:
        code = _follow(op, helper)
        if code != 0:
            tail = runtime.logs_tail(helper, settings.TOLLGATE_LOG_TAIL_LINES)
            raise FetchFailed(
                f"Could not download {source} on {node} (exit code {code})", code, tail
            )
    finally:
        runtime.stop_and_remove(helper, 0)


def _follow(op: Operation, helper: object) -> int:
    """The download's exit code; its progress bar becomes the operation's progress."""
    deadline = time.monotonic() + settings.TOLLGATE_STAGE_TIMEOUT
    while time.monotonic() < deadline:
        runtime.refresh(helper)
        pct = progress.download_progress(runtime.logs_tail(helper, 20))
        if pct is not None:
            update_op(op, progress=round(min(pct, 90.0), 1))
        if helper.status in {"exited", "dead"}:
            return runtime.exit_code(helper)
        time.sleep(settings.TOLLGATE_ENGINE_POLL_SECONDS)
    raise FetchFailed(f"The download of {op.adapter.source} did not finish in time")


def copy_upload(op: Operation, dc: DockerClient, adapter: Adapter, labels: dict[str, str]) -> None:
    """Copy the upload's tar into this node's cache (tollgate-adapters/<folder>/)."""
    node, path = op.node, upload_archive(adapter.source)
    if path is None or not path.is_file():
        raise FetchFailed(
            f"The uploaded files of {adapter} are not in this worker's upload folder "
            f"({settings.TOLLGATE_UPLOAD_DIR}): upload them again"
        )
    size = path.stat().st_size
    update_op(
        op,
        phase="copy",
        progress=0.0,
        message=f"copying the uploaded files ({size / 1e6:.1f} MB) into the cache on {node.name}",
    )
    with path.open("rb") as archive:
        runtime.copy_into_cache(
            dc,
            op.detail["image"],
            labels,
            f"{settings.TOLLGATE_STACK_ID}-adapter-copy-{op.pk}",
            archive,
        )
