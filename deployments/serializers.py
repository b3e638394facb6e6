"""Admin API representations of catalogue models, nodes, deployments and operations."""

from typing import Any

from rest_framework import serializers

from core.api import ModelSerializer, Serializer
from deployments.models import (
    ALLOWED_IMAGE_FIELDS,
    DEPLOYMENT_FIELDS,
    MODEL_FIELDS,
    NODE_FIELDS,
    PROFILE_FIELDS,
    AllowedImage,
    CatalogModel,
    Deployment,
    EngineProfile,
    Node,
    Operation,
    Replica,
    StagedModel,
)
from tenants.models import Tenant


class CatalogModelSerializer(ModelSerializer):
    granted_tenants = serializers.SlugRelatedField(slug_field="slug", many=True, read_only=True)

    class Meta:
        model = CatalogModel
        fields = ["id", *MODEL_FIELDS, "granted_tenants", "created_at"]
        read_only_fields = ["created_at"]

    def to_representation(self, instance: CatalogModel) -> dict[str, Any]:
        data = super().to_representation(instance)
        request = self.context.get("request")
        if request is None or not request.user.is_staff:
            # Tenants never learn which other tenants a private model is granted to.
            data.pop("granted_tenants", None)
            data.pop("source", None)
            data.pop("revision", None)
            data.pop("trust_remote_code", None)
            data.pop("kv_bytes_per_token", None)
        return data


class GrantSerializer(Serializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())


class NodeSerializer(ModelSerializer):
    class Meta:
        model = Node
        fields = [
            "id",
            *NODE_FIELDS,
            "available_memory_bytes",
            "cpu_count",
            "docker_version",
            "last_seen_at",
            "credential_issued_at",
            "revoked_at",
            "created_at",
        ]
        read_only_fields = [
            "credential_issued_at",
            "revoked_at",
            "available_memory_bytes",
            "cpu_count",
            "docker_version",
            "last_seen_at",
            "created_at",
        ]
        extra_kwargs = {"queue": {"required": False}}


class ReplicaSerializer(ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    worker_node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = Replica
        fields = [
            "index",
            "node",
            "container_name",
            "worker_node",
            "worker_container_name",
            "host",
            "port",
            "state",
            "healthy",
            "restart_count",
            "crash_count",
            "next_restart_at",
            "exit_code",
            "started_at",
            "ready_at",
            "last_health_at",
            "last_error",
        ]
        read_only_fields = fields


class DeploymentSerializer(ModelSerializer):
    model = serializers.SlugRelatedField(
        slug_field="served_name", queryset=CatalogModel.objects.all()
    )
    node = serializers.SlugRelatedField(
        slug_field="name", queryset=Node.objects.all(), required=False, allow_null=True
    )
    worker_node = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Node.objects.all(),
        required=False,
        allow_null=True,
        help_text="Two-box tensor parallelism: the Ray worker's node (empty: Tollgate picks).",
    )
    engine_args = serializers.JSONField(
        required=False, help_text='vLLM flags from the allow-list, e.g. {"max-num-seqs": 4}.'
    )
    profile = serializers.SlugRelatedField(
        slug_field="name", queryset=EngineProfile.objects.all(), required=False, allow_null=True
    )
    env = serializers.JSONField(
        required=False,
        help_text='Extra engine environment (allow-listed names), e.g. {"NCCL_DEBUG": "INFO"}.',
    )
    upstream_key = serializers.CharField(
        required=False,
        allow_blank=True,
        write_only=True,
        trim_whitespace=True,
        help_text="External engines: the bearer key it expects. Never returned.",
    )
    has_upstream_key = serializers.SerializerMethodField()
    replica_set = ReplicaSerializer(many=True, read_only=True)
    max_num_seqs = serializers.IntegerField(read_only=True)

    class Meta:
        model = Deployment
        fields = [
            "id",
            *DEPLOYMENT_FIELDS,
            "has_upstream_key",
            "desired_state",
            "state",
            "state_message",
            "max_num_seqs",
            "replica_set",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["desired_state", "state", "state_message", "created_at", "updated_at"]
        extra_kwargs = {"image": {"required": False}}

    def get_has_upstream_key(self, deployment: Deployment) -> bool:
        return bool(deployment.upstream_key)


class OperationSerializer(ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    model = serializers.SlugRelatedField(slug_field="served_name", read_only=True, allow_null=True)

    class Meta:
        model = Operation
        fields = [
            "id",
            "kind",
            "status",
            "deployment",
            "node",
            "model",
            "phase",
            "progress",
            "message",
            "error",
            "detail",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class EngineProfileSerializer(ModelSerializer):
    class Meta:
        model = EngineProfile
        fields = ["id", *PROFILE_FIELDS, "builtin", "created_at"]
        read_only_fields = ["builtin", "created_at"]


class AllowedImageSerializer(ModelSerializer):
    class Meta:
        model = AllowedImage
        fields = ["id", *ALLOWED_IMAGE_FIELDS, "created_at"]
        read_only_fields = ["created_at"]


class StagedModelSerializer(ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="served_name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = StagedModel
        fields = ["id", "model", "node", "revision", "size_bytes", "staged_at"]
        read_only_fields = fields


class StageSerializer(Serializer):
    node = serializers.SlugRelatedField(slug_field="name", queryset=Node.objects.all())
    image = serializers.CharField(help_text="Engine image whose Hugging Face CLI downloads.")


class LogsQuerySerializer(serializers.Serializer):
    """The query of ``…/logs/`` (other query parameters are not this serializer's)."""

    replica = serializers.IntegerField(
        min_value=0, default=0, help_text="Which replica (0 is the first)."
    )
    lines = serializers.IntegerField(
        min_value=1, max_value=5000, default=200, help_text="How many of the last lines."
    )


class MemoryFitSerializer(Serializer):
    fits = serializers.BooleanField()
    message = serializers.CharField(help_text="The arithmetic, in words.")


class LogsSerializer(Serializer):
    replica = serializers.IntegerField()
    lines = serializers.IntegerField()
    log = serializers.CharField()


class JoinTokenRequestSerializer(Serializer):
    node_name = serializers.CharField(max_length=63, help_text="The new node's name.")
    control_plane = serializers.CharField(
        max_length=255,
        required=False,
        allow_blank=True,
        help_text="URL the node reaches this control plane's console and API at, e.g. "
        "http://10.0.0.1 (shown in the command; its Redis is reached on the same host).",
    )


class NodeJoinSerializer(Serializer):
    """What a node agent presents when it joins (its join token is the Authorization)."""

    name = serializers.CharField(max_length=63)
    engine_host = serializers.CharField(max_length=255)
    high_speed_interface = serializers.CharField(max_length=32, required=False, allow_blank=True)
    high_speed_address = serializers.IPAddressField(required=False, allow_null=True)
    unified_memory = serializers.BooleanField(required=False, default=False)


class NodeCredentialSerializer(Serializer):
    name = serializers.CharField()
    redis_user = serializers.CharField()
    redis_password = serializers.CharField(help_text="Shown only in this response.")
    key_base = serializers.CharField(
        help_text="The only Redis keys this node may touch: <key_base>:*."
    )


class JoinTokenSerializer(Serializer):
    node_name = serializers.CharField()
    token = serializers.CharField(help_text="Shown only in this response.")
    expires_at = serializers.DateTimeField()
    command = serializers.CharField(help_text="Run this on the new box.")
