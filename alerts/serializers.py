"""Admin API representations of webhook endpoints, their deliveries and console notices."""

from typing import Any

from rest_framework import serializers

from alerts.models import ENDPOINT_FIELDS, Notice, WebhookDelivery, WebhookEndpoint
from core.api import ModelSerializer
from tenants import access
from tenants.models import Tenant


class TenantSlugOrPlatform(serializers.SlugRelatedField):
    """A tenant by slug among the requesting user's tenants (another's: not found); null or
    absent: a platform endpoint (platform admins only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(slug_field="slug", queryset=Tenant.objects.all(), **kwargs)

    def get_queryset(self) -> Any:
        return access.tenants_of(self.context["request"].user)


class WebhookEndpointSerializer(ModelSerializer):
    tenant = TenantSlugOrPlatform(
        required=False,
        allow_null=True,
        default=None,
        help_text="The tenant whose events the endpoint receives; null: a platform endpoint.",
    )
    # Checked by alerts.services.validate_url, which (unlike Django's URL check) allows
    # internal host names such as a Compose service's.
    url = serializers.CharField(max_length=2000)
    events = serializers.ListField(
        child=serializers.CharField(),
        help_text="Events to receive: budget.threshold; platform endpoints also engine.drift.",
    )
    secret_hint = serializers.CharField(read_only=True)
    created_by = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )

    class Meta:
        model = WebhookEndpoint
        fields = [
            "id",
            *ENDPOINT_FIELDS,
            "secret_hint",
            "secret_rotated_at",
            "created_by",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["secret_rotated_at", "created_at", "updated_at"]


class WebhookEndpointSecretSerializer(WebhookEndpointSerializer):
    secret = serializers.CharField(
        read_only=True,
        help_text="The signing secret. Shown only in this response; Tollgate keeps it encrypted.",
    )

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]


class WebhookDeliverySerializer(ModelSerializer):
    endpoint = serializers.PrimaryKeyRelatedField(read_only=True)
    tenant = serializers.SlugRelatedField(
        source="endpoint.tenant", slug_field="slug", read_only=True, allow_null=True
    )

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "endpoint",
            "tenant",
            "event",
            "status",
            "attempts",
            "response_code",
            "response_excerpt",
            "error",
            "next_attempt_at",
            "last_attempt_at",
            "created_at",
            "updated_at",
            "payload",
        ]
        read_only_fields = fields


class NoticeSerializer(ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    acknowledged_by = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )

    class Meta:
        model = Notice
        fields = [
            "id",
            "tenant",
            "event",
            "severity",
            "title",
            "detail",
            "payload",
            "created_at",
            "acknowledged_at",
            "acknowledged_by",
        ]
        read_only_fields = fields
