"""One error shape for all of ``/api/``: RFC 9457 problem details (``application/problem+json``).

Every error the admin API answers — a DRF exception, a Django ``ValidationError`` raised by a
service, a database conflict, an unknown ``/api/…`` path, a crash — becomes::

    {"type": "/api/problems/validation-error", "title": "…", "status": 400,
     "detail": "…", "instance": "/api/v1/tenants/",
     "errors": [{"field": "name", "message": "This field is required."}]}

``errors`` is present on 400 and 409 answers whose cause is a field (``field`` is ``null`` for
errors about the request as a whole). ``type`` resolves: ``GET /api/problems/`` lists them.
"""

import json
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DataError, IntegrityError
from django.http import HttpRequest, HttpResponse, HttpResponsePermanentRedirect, JsonResponse
from django.urls import Resolver404, resolve
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler

from core.errors import Conflict

MEDIA_TYPE = "application/problem+json"
API_PREFIX = "/api/"


@dataclass(frozen=True)
class ProblemType:
    """One kind of problem the API answers with: its ``type`` slug, status and title."""

    slug: str
    status: int
    title: str
    description: str

    @property
    def uri(self) -> str:
        return f"/api/problems/{self.slug}"


PROBLEM_TYPES = {
    p.slug: p
    for p in [
        ProblemType(
            "validation-error",
            400,
            "The request has invalid fields.",
            "A field is missing, unknown, read-only or has a value the API cannot accept; "
            "`errors` names each field.",
        ),
        ProblemType(
            "malformed-request",
            400,
            "The request could not be read.",
            "The body is not a JSON object, or a query parameter cannot be parsed.",
        ),
        ProblemType(
            "not-authenticated",
            401,
            "Authentication is required.",
            "Send an admin API token as `Authorization: Bearer tga-…` (a missing, wrong, "
            "revoked or expired token looks the same).",
        ),
        ProblemType(
            "permission-denied",
            403,
            "You may not do this.",
            "You are signed in but your role does not allow this action.",
        ),
        ProblemType(
            "not-found",
            404,
            "Not found.",
            "Nothing with this name or id exists, or it belongs to another tenant.",
        ),
        ProblemType(
            "method-not-allowed",
            405,
            "Method not allowed.",
            "This path does not answer this HTTP method; the `Allow` header lists those it does.",
        ),
        ProblemType(
            "not-acceptable",
            406,
            "Not acceptable.",
            "The `Accept` header asks for a format this endpoint cannot produce.",
        ),
        ProblemType(
            "conflict",
            409,
            "The request conflicts with the current state.",
            "A name or slug is taken, or the object is in a state that forbids the action "
            "(e.g. removing a running deployment); `detail` says which.",
        ),
        ProblemType(
            "request-too-large",
            413,
            "The request body is too large.",
            "Send a smaller body.",
        ),
        ProblemType(
            "unsupported-media-type",
            415,
            "Unsupported media type.",
            "Send the body as `application/json`.",
        ),
        ProblemType(
            "too-many-requests",
            429,
            "Too many requests.",
            "Slow down; `Retry-After` says after how many seconds to try again.",
        ),
        ProblemType(
            "server-error",
            500,
            "Internal server error.",
            "Tollgate failed to answer; the error is in the `web` service's log.",
        ),
    ]
}

_BY_STATUS = {p.status: p for p in reversed(PROBLEM_TYPES.values())}
_BY_EXCEPTION: list[tuple[type[Exception], str]] = [
    (exceptions.ParseError, "malformed-request"),
    (exceptions.ValidationError, "validation-error"),
    (exceptions.NotAuthenticated, "not-authenticated"),
    (exceptions.AuthenticationFailed, "not-authenticated"),
    (exceptions.PermissionDenied, "permission-denied"),
    (exceptions.NotFound, "not-found"),
    (exceptions.MethodNotAllowed, "method-not-allowed"),
    (exceptions.NotAcceptable, "not-acceptable"),
    (exceptions.UnsupportedMediaType, "unsupported-media-type"),
    (exceptions.Throttled, "too-many-requests"),
]
# Error codes that mean "taken" (DRF's and Django's unique validators): a 409, not a 400.
CONFLICT_CODES = {"unique", "unique_together", "conflict"}
NON_FIELD_KEYS = {api_settings.NON_FIELD_ERRORS_KEY, "__all__", "detail"}


class ConflictError(exceptions.APIException):
    """DRF's form of a 409: keeps the field errors of the validation it came from."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


def problem(
    request: HttpRequest | None,
    status_code: int,
    detail: str,
    *,
    slug: str | None = None,
    errors: list[dict[str, str | None]] | None = None,
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    """The problem+json response. A plain Django response, so no renderer (not even the
    browsable API's HTML) can change its shape."""
    kind = PROBLEM_TYPES[slug] if slug else _BY_STATUS.get(status_code)
    body: dict[str, Any] = {
        "type": kind.uri if kind else "about:blank",
        "title": kind.title if kind else "Error.",
        "status": status_code,
        "detail": detail,
        "instance": request.path if request is not None else None,
    }
    if errors is not None:
        body["errors"] = errors
    response = HttpResponse(
        json.dumps(body, cls=DjangoJSONEncoder), status=status_code, content_type=MEDIA_TYPE
    )
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def field_errors(detail: Any, path: str | None = None) -> list[dict[str, str | None]]:
    """DRF's nested error structure as a flat list of ``{field, message}`` (dotted paths)."""
    if isinstance(detail, dict):
        found = []
        for key, value in detail.items():
            name = None if key in NON_FIELD_KEYS else str(key)
            found += field_errors(value, _join(path, name))
        return found
    if isinstance(detail, list | tuple):
        if all(not isinstance(item, dict | list | tuple) for item in detail):
            return [{"field": path, "message": str(item)} for item in detail]
        found = []
        for index, item in enumerate(detail):
            found += field_errors(item, _join(path, str(index))) if item else []
        return found
    return [{"field": path, "message": str(detail)}]


def _join(path: str | None, name: str | None) -> str | None:
    if name is None:
        return path
    return f"{path}.{name}" if path else name


def _codes(codes: Any) -> set[str]:
    if isinstance(codes, dict):
        return set().union(*(_codes(c) for c in codes.values())) if codes else set()
    if isinstance(codes, list | tuple):
        return set().union(*(_codes(c) for c in codes)) if codes else set()
    return {str(codes)}


def _from_django(exc: DjangoValidationError) -> exceptions.APIException:
    """A service's ValidationError (or Conflict) as DRF's exception, codes kept."""
    if hasattr(exc, "error_dict"):
        detail: Any = {
            field: [exceptions.ErrorDetail(m, e.code or "invalid") for e in errs for m in e]
            for field, errs in exc.error_dict.items()
        }
    else:
        detail = {
            api_settings.NON_FIELD_ERRORS_KEY: [
                exceptions.ErrorDetail(m, e.code or "invalid") for e in exc.error_list for m in e
            ]
        }
    if isinstance(exc, Conflict):
        return ConflictError(detail=detail)
    return exceptions.ValidationError(detail=detail)


def _summary(errors: list[dict[str, str | None]]) -> str:
    parts = [f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in errors]
    return " ".join(str(p) for p in parts[:5]) + (" …" if len(parts) > 5 else "")


def exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse | None:
    """DRF's exception handler, answering with problem details."""
    if isinstance(exc, DjangoValidationError):
        exc = _from_django(exc)
    elif isinstance(exc, IntegrityError):
        # Two requests raced for one name: the loser learns it is taken, not that we crashed.
        exc = ConflictError(detail="Another object with the same name or key exists already.")
    elif isinstance(exc, DataError):
        # PostgreSQL refused a value the validators let through (a NUL byte in a name, a
        # time zone offset out of range in a filter): the request's fault, not ours.
        reason = str(exc).splitlines()[0] if str(exc) else "a value is out of range"
        exc = exceptions.ParseError(f"A value cannot be used: {reason}.")
    if isinstance(exc, exceptions.ValidationError) and _codes(exc.get_codes()) & CONFLICT_CODES:
        exc = ConflictError(detail=exc.detail)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # not an API error: Django's 500 handler answers (with a problem too)
    request = context.get("request")
    headers = {k: v for k, v in response.items() if k in ("WWW-Authenticate", "Retry-After")}
    if isinstance(exc, exceptions.ValidationError | ConflictError) and not isinstance(
        exc.detail, str
    ):
        errors = field_errors(exc.detail)
        return problem(
            request, response.status_code, _summary(errors), errors=errors, headers=headers
        )
    slug = next((s for cls, s in _BY_EXCEPTION if isinstance(exc, cls)), None)
    detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
    if isinstance(detail, list | dict):
        errors = field_errors(detail)
        return problem(
            request, response.status_code, _summary(errors), errors=errors, headers=headers
        )
    if isinstance(exc, exceptions.MethodNotAllowed) and "Allow" in response:
        headers["Allow"] = response["Allow"]
    return problem(request, response.status_code, str(detail), slug=slug, headers=headers)


# --- Django's handlers: the same shape for what never reaches a DRF view ----------------------


def _is_api(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIX)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not _is_api(request):
        return defaults.bad_request(request, exception)
    if exception.__class__.__name__ == "RequestDataTooBig":
        return problem(request, 413, "The request body is too large.")
    return problem(request, 400, "The request could not be read.", slug="malformed-request")


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not _is_api(request):
        return defaults.permission_denied(request, exception)
    return problem(request, 403, str(exception) or "You may not do this.")


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not _is_api(request):
        return defaults.page_not_found(request, exception)
    return problem(request, 404, f"No API endpoint at {request.path}.")


def server_error(request: HttpRequest) -> HttpResponse:
    if not _is_api(request):
        return defaults.server_error(request)
    return problem(request, 500, "Tollgate failed to answer; the error is in the web log.")


@csrf_exempt  # answers every method with a 404; a console cookie must not make it a 403 page
def api_not_found(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Any path under /api/ no route matched, whatever the method (and with DEBUG on).

    A known path without its final slash is redirected for GET (as Django's APPEND_SLASH
    would) and named in the 404 otherwise, since a redirect would lose a body."""
    if not request.path.endswith("/"):
        match = resolve_or_none(request.path + "/")
        if match is not None and match.func is not api_not_found:
            if request.method in ("GET", "HEAD"):
                query = request.META.get("QUERY_STRING")
                return HttpResponsePermanentRedirect(
                    request.path + "/" + (f"?{query}" if query else "")
                )
            return problem(request, 404, f"No API endpoint at {request.path}; use {request.path}/.")
    return page_not_found(request, Exception())


def resolve_or_none(path: str) -> Any:
    try:
        return resolve(path)
    except Resolver404:
        return None


@csrf_exempt  # read-only; other methods are a 405 problem, never the CSRF page
def problem_types(request: HttpRequest, slug: str | None = None) -> HttpResponse:
    """``GET /api/problems/`` (every type) and ``/api/problems/<slug>`` (one): what a
    problem's ``type`` means."""
    if request.method not in ("GET", "HEAD"):
        return problem(request, 405, "Only GET.", headers={"Allow": "GET, HEAD"})
    if slug is None:
        return JsonResponse({"problems": [_describe(p) for p in PROBLEM_TYPES.values()]})
    kind = PROBLEM_TYPES.get(slug)
    if kind is None:
        return problem(request, 404, f"No problem type {slug!r}.")
    return JsonResponse(_describe(kind))


def _describe(kind: ProblemType) -> dict[str, Any]:
    return {
        "type": kind.uri,
        "status": kind.status,
        "title": kind.title,
        "description": kind.description,
    }
