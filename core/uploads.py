"""Hard caps on request bodies sent to Django (the console, /api and /v1's files).

Under ASGI, Django reads a whole body into a temporary file before any middleware or view
runs, so a view's own check of the size comes too late to keep a too large body off the
disk. Two caps therefore:

- ``BodyLimit``, around Django's ASGI application: a body declared larger than its route
  takes is answered 413 before a byte of it is read, and one sent without a length
  (chunked) is cut off as soon as it passes the limit, in the route's own error shape;
- ``BoundedUploadHandler``, first in FILE_UPLOAD_HANDLERS, for servers that hand Django the
  body as a stream (the development server): it stops keeping a file once it passes the
  route's limit and marks the request, so that the view refuses it in its own terms
  (``refused_upload``).

Limits: an adapter archive's (TOLLGATE_ADAPTER_MAX_BYTES) on the adapter upload routes, a
batch file's (TOLLGATE_BATCH_MAX_FILE_BYTES) on /v1/files, TOLLGATE_MAX_BODY_BYTES on every
other route; each with room for the form's other fields.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, SkipFile

ATTRIBUTE = "tollgate_upload_refused"


@dataclass(frozen=True)
class Refused:
    """A file dropped while it was read: which field, and the limit it passed."""

    field: str
    limit: int
    setting: str


# Room for a form's other fields (and the multipart framing) beside its file.
FORM_SLACK_BYTES = 1024 * 1024
# The routes that take an adapter's archive: the admin API's create and upload, the
# console's add and edit forms.
ADAPTER_UPLOADS = re.compile(r"/api/v1/adapters/(?:.+/upload/)?|/adapters/(?:new|\d+/edit)/")


def limit_for(path: str) -> tuple[int, str]:
    """The largest file a route takes (bytes) and the setting that says so."""
    if path.startswith("/v1/files"):
        return settings.TOLLGATE_BATCH_MAX_FILE_BYTES, "TOLLGATE_BATCH_MAX_FILE_BYTES"
    if ADAPTER_UPLOADS.fullmatch(path):
        return settings.TOLLGATE_ADAPTER_MAX_BYTES, "TOLLGATE_ADAPTER_MAX_BYTES"
    return settings.TOLLGATE_MAX_BODY_BYTES, "TOLLGATE_MAX_BODY_BYTES"


class BoundedUploadHandler(FileUploadHandler):
    """Drops a file past its route's limit before the next handler stores the excess."""

    def new_file(self, field_name: str, *args: Any, **kwargs: Any) -> None:
        super().new_file(field_name, *args, **kwargs)
        path = self.request.path if self.request is not None else ""
        self.limit, self.setting = limit_for(path)

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        if start + len(raw_data) > self.limit:
            if self.request is not None:
                setattr(self.request, ATTRIBUTE, Refused(self.field_name, self.limit, self.setting))
            raise SkipFile()  # the parser reads the rest of this file and keeps none of it
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None  # the next handler makes the file


def refused_upload(request: Any) -> Refused | None:
    """The file this request's body carried and the handler dropped, if any (a DRF request
    passes the attribute through to Django's)."""
    return getattr(request, ATTRIBUTE, None)


# --- Before Django reads the body -----------------------------------------------------------


class BodyTooLarge(Exception):
    """The client sent more than the route takes."""


class BodyLimit:
    """ASGI middleware: refuses or cuts off a body larger than its route takes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        file_limit, setting = limit_for(scope["path"])
        limit = file_limit + FORM_SLACK_BYTES
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await _refuse(scope, send, file_limit, setting)
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except BodyTooLarge:
            # Django raises it while reading the body, before it answers anything.
            await _refuse(scope, send, file_limit, setting)


def _size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 10**9 else f"{size / 1e6:.1f} MB"


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _refuse(scope: dict, send: Any, limit: int, setting: str) -> None:
    """413 in the shape the route's clients read: problem details on /api, OpenAI's error
    on /v1, a page in the console."""
    path = scope["path"]
    what = "request body" if setting == "TOLLGATE_MAX_BODY_BYTES" else "file"
    message = f"The {what} is larger than the {_size(limit)} this takes ({setting})."
    if path.startswith("/api/"):
        kind = "application/problem+json"
        body = {
            "type": "/api/problems/request-too-large",
            "title": "The request body is too large.",
            "status": 413,
            "detail": message,
            "instance": path,
        }
        data = json.dumps(body).encode()
    elif path.startswith("/v1/"):
        kind = "application/json"
        error = {"message": message, "type": "invalid_request_error", "param": "file"}
        data = json.dumps({"error": {**error, "code": "file_too_large"}}).encode()
    else:
        kind = "text/html; charset=utf-8"
        data = (
            "<!doctype html><title>Too large — Tollgate</title>"
            f"<h1>The upload is too large</h1><p>{html.escape(message)}</p>"
            "<p>Go back and choose a smaller file.</p>"
        ).encode()
    headers = [
        (b"content-type", kind.encode()),
        (b"content-length", str(len(data)).encode()),
        (b"connection", b"close"),  # the rest of the body is not read
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": data})
