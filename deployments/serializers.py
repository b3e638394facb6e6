"""Admin API representations of catalogue models, nodes, deployments and operations."""

from typing import Any

from rest_framework import serializers

from deployments.models import CatalogModel, Deployment, Node, Operation, Replica
from tenants.models import Tenant


class CatalogModelSerializer(serializers.ModelSerializer):
    granted_tenants = serializers.SlugRelatedField(slug_field="slug", many=True, read_only=True)

    class Meta:
        model = CatalogModel
        fields = [
            "id",
            "served_name",
            "source",
            "revision",
            "task",
            "params_billions",
            "active_params_billions",
            "quantization",
            "context_length",
            "visibility",
            "granted_tenants",
            "trust_remote_code",
            "description",
            "created_at",
        ]
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
        return data


class GrantSerializer(serializers.Serializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", queryset=Tenant.objects.all())


class NodeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "docker_url",
            "queue",
            "engine_host",
            "arch",
            "gpu_description",
            "gpu_count",
            "total_memory_bytes",
            "unified_memory",
            "status",
            "last_seen_at",
            "created_at",
        ]
        read_only_fields = ["last_seen_at", "created_at"]
        extra_kwargs = {"queue": {"required": False}}


class ReplicaSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Replica
        fields = [
            "index",
            "node",
            "container_name",
            "host",
            "port",
            "state",
            "healthy",
            "restart_count",
            "started_at",
            "ready_at",
            "last_health_at",
            "last_error",
        ]
        read_only_fields = fields


class DeploymentSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(
        slug_field="served_name", queryset=CatalogModel.objects.all()
    )
    node = serializers.SlugRelatedField(
        slug_field="name", queryset=Node.objects.all(), required=False, allow_null=True
    )
    engine_args = serializers.JSONField(
        required=False, help_text='vLLM flags from the allow-list, e.g. {"max-num-seqs": 4}.'
    )
    replica_set = ReplicaSerializer(many=True, read_only=True)
    max_num_seqs = serializers.IntegerField(read_only=True)

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "model",
            "node",
            "image",
            "engine_args",
            "replicas",
            "desired_state",
            "state",
            "state_message",
            "max_num_seqs",
            "replica_set",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["desired_state", "state", "state_message", "created_at", "updated_at"]


class OperationSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    model = serializers.SlugRelatedField(slug_field="served_name", read_only=True)

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
