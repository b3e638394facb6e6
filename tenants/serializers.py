"""Admin API representations of tenants, members, users, keys, tokens and audit rows."""

from typing import Any

from django.contrib.auth import get_user_model
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api import ModelSerializer, Serializer
from tenants import access
from tenants.models import (
    KEY_FIELDS,
    LIMIT_FIELDS,
    MEMBERSHIP_FIELDS,
    TENANT_FIELDS,
    TOKEN_FIELDS,
    USER_FIELDS,
    AdminToken,
    ApiKey,
    AuditLog,
    Membership,
    Tenant,
)

User = get_user_model()


@extend_schema_field(OpenApiTypes.STR)
class VisibleModelsField(serializers.SlugRelatedField):
    """Catalogue models by served name, limited to those the requesting user may see.

    A private model of another tenant is "does not exist", exactly like a missing one.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(slug_field="served_name", **kwargs)

    def get_queryset(self) -> Any:
        return access.catalogue().models_visible_to(self.context["request"].user)


class TenantSerializer(ModelSerializer):
    allowed_models = VisibleModelsField(
        many=True,
        required=False,
        help_text="With model_access 'listed': the served names this tenant may call.",
    )

    class Meta:
        model = Tenant
        fields = [
            "id",
            *TENANT_FIELDS,
            "status",
            "priority_boost_until",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["status", "priority_boost_until", "created_at", "updated_at"]
        extra_kwargs = {"slug": {"required": False}}


class TenantSlugField(serializers.SlugRelatedField):
    """A tenant by slug, limited to the tenants the requesting user belongs to.

    Another tenant's slug is "not found"; whether the user may change things in their own
    tenant is the view's question (403).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(slug_field="slug", queryset=Tenant.objects.all(), **kwargs)

    def get_queryset(self) -> Any:
        return access.tenants_of(self.context["request"].user)


class ApiKeySerializer(ModelSerializer):
    tenant = TenantSlugField()
    key_hint = serializers.CharField(source="masked", read_only=True)
    status = serializers.CharField(read_only=True)
    created_by = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True
    )
    allowed_models = VisibleModelsField(
        many=True, required=False, help_text="Empty: every model the tenant may use."
    )

    class Meta:
        model = ApiKey
        fields = [
            "id",
            *KEY_FIELDS,
            "prefix",
            "key_hint",
            "status",
            "created_by",
            "created_at",
            "revoked_at",
            "last_used_at",
        ]
        read_only_fields = ["prefix", "created_at", "revoked_at", "last_used_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        tenant = attrs.get("tenant") or (self.instance.tenant if self.instance else None)
        if self.instance and "tenant" in attrs and attrs["tenant"] != self.instance.tenant:
            raise serializers.ValidationError({"tenant": "A key cannot move to another tenant."})
        errors = {}
        for field in LIMIT_FIELDS:
            mine, theirs = attrs.get(field), getattr(tenant, field) if tenant else None
            if mine is not None and theirs is not None and mine > theirs:
                errors[field] = f"Must not exceed the tenant's limit of {theirs}."
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(
        read_only=True, help_text="The key itself. Shown only in this response."
    )

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class MembershipSerializer(ModelSerializer):
    tenant = TenantSlugField()
    user = serializers.SlugRelatedField(
        slug_field="username", queryset=User.objects.filter(is_active=True)
    )

    class Meta:
        model = Membership
        fields = ["id", *MEMBERSHIP_FIELDS, "created_at"]
        read_only_fields = ["created_at"]


class UserSerializer(ModelSerializer):
    password = serializers.CharField(
        write_only=True, required=False, style={"input_type": "password"}
    )
    tenants = serializers.SerializerMethodField()

    class Meta:
        model = User
        fields = ["id", *USER_FIELDS, "password", "tenants", "date_joined", "last_login"]
        read_only_fields = ["date_joined", "last_login"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # A new user needs a password (an empty form field arrives as no field at all);
        # an update may leave it as it is.
        if self.instance is None and not attrs.get("password"):
            raise serializers.ValidationError({"password": "A new user needs a password."})
        return super().validate(attrs)

    def get_tenants(self, user: Any) -> list[dict[str, str]]:
        return [
            {"tenant": m.tenant.slug, "role": m.role}
            for m in user.memberships.select_related("tenant")
        ]


class AdminTokenSerializer(ModelSerializer):
    token_hint = serializers.SerializerMethodField()

    class Meta:
        model = AdminToken
        fields = [
            "id",
            *TOKEN_FIELDS,
            "prefix",
            "token_hint",
            "created_at",
            "revoked_at",
            "last_used_at",
        ]
        read_only_fields = ["prefix", "created_at", "revoked_at", "last_used_at"]

    def get_token_hint(self, token: AdminToken) -> str:
        return f"tga-{token.prefix}-…"


class AdminTokenCreatedSerializer(AdminTokenSerializer):
    token = serializers.CharField(
        read_only=True, help_text="The token itself. Shown only in this response."
    )

    class Meta(AdminTokenSerializer.Meta):
        fields = [*AdminTokenSerializer.Meta.fields, "token"]


class AuditLogSerializer(ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)

    class Meta:
        model = AuditLog
        fields = [
            "id",
            "at",
            "actor_label",
            "tenant",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "changes",
        ]
        read_only_fields = fields


class BoostSerializer(Serializer):
    minutes = serializers.IntegerField(
        min_value=0, max_value=24 * 60, help_text="0 ends the boost."
    )
