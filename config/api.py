"""Shared pieces of the admin REST API."""

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler; a Django ValidationError raised by a service becomes a 400."""
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "error_dict"):
            exc = exceptions.ValidationError(detail=exc.message_dict)
        else:
            exc = exceptions.ValidationError(detail={"non_field_errors": exc.messages})
    return drf_exception_handler(exc, context)


class UserScopedMixin:
    """Viewsets whose rows depend on who asks. Subclasses implement ``scope(user)``.

    ``queryset`` names the model for the schema generator, which has no real user.
    """

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):
            return self.queryset
        return self.scope(self.request.user)


class RejectUnknownFieldsMixin:
    """A serializer that answers 400 for fields it does not know instead of ignoring them:
    for objects that become containers, a silently dropped field is a surprise."""

    def to_internal_value(self, data: Any) -> Any:
        if hasattr(data, "keys"):
            unknown = sorted(set(data.keys()) - set(self.fields))
            if unknown:
                raise exceptions.ValidationError(
                    {name: ["Unknown field: Tollgate does not accept it here."] for name in unknown}
                )
        return super().to_internal_value(data)
