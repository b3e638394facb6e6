"""``/v1/files`` and ``/v1/batches``: OpenAI's Files and Batch APIs for tenant keys.

Plain Django views (not the gateway hot path): they authenticate the tenant key by the
gateway's rule (``tenants.auth.authenticate_api_key``), and answer every error in OpenAI's
``{"error": {...}}`` shape. Files and batches belong to the tenant: any of its keys sees
them; another tenant's answer 404.
"""

from collections.abc import Callable
from functools import wraps
from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from batches import render, services
from batches.services import RequestError
from core.uploads import refused_upload
from tenants.auth import authenticate_api_key, invalid_key
from tenants.models import ApiKey

View = Callable[..., HttpResponse]


def error(exc: RequestError) -> JsonResponse:
    body = {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }
    return JsonResponse(body, status=exc.status)


def api(*methods: str) -> Callable[[View], View]:
    """Tenant-key authentication, allowed methods and OpenAI-shaped errors for a view."""

    def wrap(view: View) -> View:
        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            key = authenticate_api_key(request)
            if key is None:
                return invalid_key()
            if request.method not in methods:
                return error(
                    RequestError(405, f"Method {request.method} is not allowed on {request.path}.")
                )
            try:
                return view(request, key, *args, **kwargs)
            except RequestError as exc:
                return error(exc)

        return wrapper

    return wrap


def json_body(request: HttpRequest) -> dict:
    try:
        body = orjson.loads(request.body or b"{}")
    except orjson.JSONDecodeError:
        raise RequestError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    return body


def limit_of(request: HttpRequest, default: int, most: int) -> int:
    raw = request.GET.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise RequestError(400, f"limit must be a whole number from 1 to {most}.", "limit")
    return int(raw)


# --- Files ------------------------------------------------------------------------------------


@api("GET", "POST")
def files(request: HttpRequest, key: ApiKey) -> JsonResponse:
    if request.method == "POST":
        upload = request.FILES.get("file")
        if refused := refused_upload(request):  # a chunked body past the limit, cut off
            raise RequestError(
                400,
                f"The file is larger than the limit of {refused.limit} bytes.",
                "file",
                "file_too_large",
            )
        if upload is None:
            raise RequestError(400, "Send the file as the multipart field 'file'.", "file")
        services.check_size(upload.size)  # before reading a spooled upload into memory
        stored = services.upload_file(
            key, upload.name or "", upload.read(), request.POST.get("purpose", "")
        )
        return JsonResponse(render.file_object(stored))
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError(400, "order must be 'asc' or 'desc'.", "order")
    found = services.files_of(key.tenant)
    if request.GET.get("purpose"):
        found = found.filter(purpose=request.GET["purpose"])
    rows, more = services.page(
        found, request.GET.get("after"), limit_of(request, 10_000, 10_000), order == "asc"
    )
    return JsonResponse(render.page([render.file_object(f) for f in rows], more))


@api("GET", "DELETE")
def file_detail(request: HttpRequest, key: ApiKey, file_id: str) -> JsonResponse:
    if request.method == "DELETE":
        services.delete_file(key.tenant, file_id)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(render.file_object(services.get_file(key.tenant, file_id)))


@api("GET")
def file_content(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponse:
    found = services.get_file(key.tenant, file_id, with_content=True)
    response = HttpResponse(bytes(found.content), content_type="application/jsonl")
    response["Content-Disposition"] = f'attachment; filename="{found.filename}"'
    return response


# --- Batches ----------------------------------------------------------------------------------


@api("GET", "POST")
def batches(request: HttpRequest, key: ApiKey) -> JsonResponse:
    if request.method == "POST":
        body = json_body(request)
        batch = services.create_batch(
            key,
            body.get("input_file_id"),
            body.get("endpoint"),
            body.get("completion_window"),
            body.get("metadata"),
        )
        return JsonResponse(render.batch_object(batch))
    rows, more = services.page(
        services.batches_of(key.tenant), request.GET.get("after"), limit_of(request, 20, 100)
    )
    return JsonResponse(render.page([render.batch_object(b) for b in rows], more))


@api("GET")
def batch_detail(request: HttpRequest, key: ApiKey, batch_id: str) -> JsonResponse:
    return JsonResponse(render.batch_object(services.get_batch(key.tenant, batch_id)))


@api("POST")
def batch_cancel(request: HttpRequest, key: ApiKey, batch_id: str) -> JsonResponse:
    return JsonResponse(render.batch_object(services.cancel_batch(key.tenant, batch_id)))
