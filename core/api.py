"""Shared pieces of the admin REST API: one convention for every resource.

- Serializers derive from ``ModelSerializer``/``Serializer`` here, which refuse unknown and
  read-only fields with a 400 naming them (a silently dropped field is a surprise).
- Bodies are JSON objects (``core.parsers``); ``[null, null]`` is a 400, never a 500.
- Viewsets use ``AdminViewSetMixin``: actions that take no body refuse one, objects are
  addressed by their human name (with the old numeric id still answering where cheap), and
  list-shaped actions paginate like lists.
- Errors are problem details (``core.problems``).
"""

from typing import Any

from django.db.models import Model, QuerySet
from rest_framework import exceptions, serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter

UNKNOWN_FIELD = "Unknown field: Tollgate does not accept it here."
READ_ONLY_FIELD = "This field is read-only."
NO_BODY = "Unknown field: this action takes no body."


class StrictFieldsMixin:
    """A serializer that answers 400 for fields it does not know or will not write, naming
    them, instead of ignoring them."""

    def to_internal_value(self, data: Any) -> Any:
        if hasattr(data, "keys"):
            fields = self.fields  # type: ignore[attr-defined]
            errors = {
                name: [UNKNOWN_FIELD if name not in fields else READ_ONLY_FIELD]
                for name in sorted(data.keys())
                if name not in fields or fields[name].read_only
            }
            if errors:
                raise exceptions.ValidationError(errors)
        return super().to_internal_value(data)  # type: ignore[misc]


class Serializer(StrictFieldsMixin, serializers.Serializer):
    """A request or response body that is not a model row."""


class ModelSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    """A model row in the admin API."""


class UserScopedMixin:
    """Viewsets whose rows depend on who asks. Subclasses implement ``scope(user)``.

    ``queryset`` names the model for the schema generator, which has no real user.
    """

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return self.scope(self.request.user)  # type: ignore[attr-defined]


class AdminViewSetMixin:
    """The conventions every admin API viewset follows (see the module docstring)."""

    # Actions that change state without taking fields: any field sent is unknown.
    bodyless_actions = frozenset(
        {"destroy", "suspend", "activate", "revoke", "start", "stop", "restart", "remove"}
    )
    # True where objects were addressed by numeric id before they were addressed by name.
    legacy_pk_lookup = False

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        if getattr(self, "action", None) in self.bodyless_actions and request.data:
            raise exceptions.ValidationError({str(name): [NO_BODY] for name in request.data})

    def get_object(self) -> Any:
        if self.legacy_pk_lookup:
            found = self._by_legacy_pk()
            if found is not None:
                return found
        return super().get_object()  # type: ignore[misc]

    def _by_legacy_pk(self) -> Model | None:
        """The object whose numeric id the URL names, when no object has that name."""
        value = self.kwargs.get(self.lookup_url_kwarg or self.lookup_field)  # type: ignore[attr-defined]
        if not (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 12):
            return None
        rows = self.filter_queryset(self.get_queryset())  # type: ignore[attr-defined]
        if rows.filter(**{self.lookup_field: value}).exists():  # type: ignore[attr-defined]
            return None
        found = rows.filter(pk=int(value)).first()
        if found is not None:
            self.check_object_permissions(self.request, found)  # type: ignore[attr-defined]
        return found

    def paginated(self, rows: QuerySet, serializer_class: type) -> Response:
        """A list-shaped action answered like a list: paginated, ``count``/``results``."""
        page = self.paginate_queryset(rows)  # type: ignore[attr-defined]
        context = self.get_serializer_context()  # type: ignore[attr-defined]
        data = serializer_class(page, many=True, context=context).data
        return self.get_paginated_response(data)  # type: ignore[attr-defined]


class AdminRouter(DefaultRouter):
    """DRF's router, with a resource's actions matched before its detail route, so a name
    with a slash in it (``Qwen/Qwen3-8B``) never swallows ``…/grant/``."""

    routes = [
        DefaultRouter.routes[0],  # list
        DefaultRouter.routes[1],  # list-level actions
        DefaultRouter.routes[3],  # detail-level actions
        DefaultRouter.routes[2],  # detail
    ]
