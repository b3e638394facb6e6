"""Files and batches as OpenAI's JSON objects (``FileObject``, ``Batch``)."""

from datetime import datetime
from typing import Any

from batches.models import Batch, File


def ts(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment else None


def file_object(f: File) -> dict[str, Any]:
    return {
        "id": f.public_id,
        "object": "file",
        "bytes": f.size,
        "created_at": ts(f.created_at),
        "expires_at": ts(f.expires_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(b: Batch) -> dict[str, Any]:
    return {
        "id": b.public_id,
        "object": "batch",
        "endpoint": b.endpoint,
        "model": b.model or None,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id or None,
        "error_file_id": b.error_file_id or None,
        "created_at": ts(b.created_at),
        "in_progress_at": ts(b.in_progress_at),
        "expires_at": ts(b.expires_at),
        "finalizing_at": ts(b.finalizing_at),
        "completed_at": ts(b.completed_at),
        "failed_at": ts(b.failed_at),
        "expired_at": ts(b.expired_at),
        "cancelling_at": ts(b.cancelling_at),
        "cancelled_at": ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "usage": {
            "input_tokens": b.input_tokens,
            "input_tokens_details": {"cached_tokens": b.cached_tokens},
            "output_tokens": b.output_tokens,
            "output_tokens_details": {"reasoning_tokens": b.reasoning_tokens},
            "total_tokens": b.input_tokens + b.output_tokens,
        },
        "metadata": b.metadata,
    }


def page(objects: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": objects,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": has_more,
    }
