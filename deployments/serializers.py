"""Admin API representations of catalogue models, nodes, deployments and operations."""

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api import ModelSerializer, Serializer
from deployments import access, adapters, demand
from deployments.models import (
    ADAPTER_FIELDS,
    ALLOWED_IMAGE_FIELDS,
    DEPLOYMENT_FIELDS,
    MODEL_FIELDS,
    NODE_FIELDS,
    PROFILE_FIELDS,
    Adapter,
    AllowedImage,
    CatalogModel,
    Deployment,
    EngineProfile,
    Node,
    Operation,
    Replica,
    StagedModel,
    served_name_validator,
)
from tenants.access import admin_tenants, member_tenant_ids
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


class AdapterArchiveSerializer(Serializer):
    """New files for an adapter (multipart/form-data)."""

    archive = serializers.FileField(
        help_text="The adapter's files as a .tar, .tar.gz or .zip: adapter_config.json, "
        "*.safetensors weights and harmless text files (README.md …)."
    )


class MemoryBudgetSerializer(Serializer):
    """A node's memory for engines, and who holds it (read-only)."""

    usable_bytes = serializers.IntegerField(help_text="What engines on the node may use in all.")
    always_bytes = serializers.IntegerField(help_text="Held by always-running deployments.")
    on_demand_bytes = serializers.IntegerField(help_text="Held now by on-demand deployments.")
    free_bytes = serializers.IntegerField(help_text="Left for more on-demand starts.")


class NodeSerializer(ModelSerializer):
    memory_budget = serializers.SerializerMethodField()

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
            "memory_budget",
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

    @extend_schema_field(MemoryBudgetSerializer)
    def get_memory_budget(self, node: Node) -> dict[str, int]:
        return MemoryBudgetSerializer(demand.node_budget(node)).data


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


# An on-demand timeout longer than a day is a typing mistake, not a setting.
MAX_TIMEOUT_SECONDS = 24 * 3600


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
    demand_state = serializers.SerializerMethodField(
        help_text="On demand: loaded (a replica is ready), loading (a request woke it, its "
        "engine is starting) or unloaded; empty for always-running deployments."
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            *DEPLOYMENT_FIELDS,
            "has_upstream_key",
            "desired_state",
            "state",
            "state_message",
            "awake",
            "demand_state",
            "last_used_at",
            "max_num_seqs",
            "replica_set",
            "created_at",
            "updated_at",
        ]
        read_only_fields = [
            "desired_state",
            "state",
            "state_message",
            "awake",
            "last_used_at",
            "created_at",
            "updated_at",
        ]
        extra_kwargs = {
            "image": {"required": False},
            "idle_timeout_seconds": {"max_value": MAX_TIMEOUT_SECONDS},
            "start_timeout_seconds": {"max_value": MAX_TIMEOUT_SECONDS},
            "cpus": {"coerce_to_string": False},  # a number of cores, as Docker's --cpus
        }

    def get_has_upstream_key(self, deployment: Deployment) -> bool:
        return bool(deployment.upstream_key)

    @extend_schema_field(serializers.ChoiceField(choices=["loaded", "loading", "unloaded", ""]))
    def get_demand_state(self, deployment: Deployment) -> str:
        return demand.demand_state(deployment)


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
        extra_kwargs = {"cpu_headroom": {"coerce_to_string": False}}


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


# --- LoRA adapters --------------------------------------------------------------------------


class AdapterReplicaSerializer(Serializer):
    """One engine replica holding an adapter now."""

    deployment = serializers.CharField(source="deployment.name")
    replica = serializers.IntegerField(source="index")
    node = serializers.CharField(source="node.name", allow_null=True)


class AdapterListSerializer(serializers.ListSerializer):
    """A page of adapters: where each is loaded is read once for the page, not per row."""

    def to_representation(self, data: Any) -> list[dict[str, Any]]:
        rows = list(data.all() if hasattr(data, "all") else data)
        user = getattr(self.context.get("request"), "user", None)
        if user is not None and user.is_staff:
            self.context["holding"] = adapters.replicas_holding(rows)
        return super().to_representation(rows)


class AdapterSerializer(ModelSerializer):
    """A LoRA adapter. What a body may name narrows to the caller: a tenant admin's adapter
    is their tenant's, on a model it may call."""

    base = serializers.SlugRelatedField(
        slug_field="served_name",
        queryset=CatalogModel.objects.all(),
        help_text="The base model's served name (the adapter was trained on it).",
    )
    tenant = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Tenant.objects.all(),
        required=False,
        allow_null=True,
        help_text="The owner tenant's slug; its admins manage the adapter. Null: the platform's "
        "own (platform admins only). Default for a tenant admin: their tenant.",
    )
    granted_tenants = serializers.SlugRelatedField(slug_field="slug", many=True, read_only=True)
    archive = serializers.FileField(
        write_only=True,
        required=False,
        help_text="Instead of a source, on create (multipart/form-data): the adapter's files as "
        "a .tar, .tar.gz or .zip (adapter_config.json, *.safetensors, README.md …); checked "
        "before it is accepted. Its source is then a folder of Tollgate's own in the cache.",
    )
    loaded_on = serializers.SerializerMethodField(
        help_text="The ready engine replicas holding it now (platform admins only)."
    )

    # Shown to platform admins only: whom else it is shared with, and the engines.
    STAFF_ONLY = ("granted_tenants", "loaded_on")
    # Shown only to members of the owner tenant (and platform admins), not to a tenant it
    # was shared with: whose it is and where its files are.
    OWNER_ONLY = ("tenant", "source", "status_message", "pinned")

    class Meta:
        model = Adapter
        list_serializer_class = AdapterListSerializer
        fields = [
            "id",
            *ADAPTER_FIELDS,
            "archive",
            "granted_tenants",
            "status",
            "status_message",
            "rank",
            "target_modules",
            "size_bytes",
            "checked_at",
            "created_at",
            "loaded_on",
        ]
        read_only_fields = [
            "status",
            "status_message",
            "rank",
            "target_modules",
            "size_bytes",
            "checked_at",
            "created_at",
        ]
        # No unique validator here: the service checks a name is in its tenant's space
        # before it is taken, so a name in another's says nothing of the adapters there.
        extra_kwargs = {
            "served_name": {"validators": [served_name_validator]},
            "source": {"required": False},  # or an archive
        }

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        user = self._user()
        if user is not None and user.is_authenticated and not user.is_staff:
            # Another tenant's private model is as unknown here as one that does not exist.
            fields["base"].queryset = access.models_visible_to(user)
            fields["tenant"].queryset = admin_tenants(user)
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        user = self._user()
        if self.instance is not None and "archive" in attrs:
            raise serializers.ValidationError(
                {"archive": "Replace an adapter's files with its upload action."}
            )
        if self.instance is None and ("source" in attrs) == ("archive" in attrs):
            raise serializers.ValidationError(
                {
                    "source": "Give either a source (a hub id or a folder in the cache) or an "
                    "archive of the adapter's files."
                }
            )
        if self.instance is None and "tenant" not in attrs and user is not None:
            attrs["tenant"] = self._default_tenant(user)
        return attrs

    def _default_tenant(self, user: Any) -> Tenant | None:
        """None for a platform admin (the platform's own); a tenant admin's one tenant."""
        if user.is_staff:
            return None
        tenants = list(admin_tenants(user)[:2])
        if len(tenants) != 1:
            raise serializers.ValidationError({"tenant": "Say which of your tenants owns it."})
        return tenants[0]

    @extend_schema_field(AdapterReplicaSerializer(many=True))
    def get_loaded_on(self, adapter: Adapter) -> list[dict[str, Any]]:
        user = self._user()
        if user is None or not user.is_staff:
            return []
        holding = self.context.get("holding") or {}
        replicas = holding.get(adapter.pk)
        if replicas is None:
            replicas = adapters.replicas_holding([adapter])[adapter.pk]
        return AdapterReplicaSerializer(replicas, many=True).data

    def to_representation(self, instance: Adapter) -> dict[str, Any]:
        data = super().to_representation(instance)
        user = self._user()
        if user is None or user.is_staff:
            return data
        hidden = list(self.STAFF_ONLY)
        if instance.tenant_id not in self._member_of(user):
            hidden += self.OWNER_ONLY
        for name in hidden:
            data.pop(name, None)
        return data

    def _user(self) -> Any:
        return getattr(self.context.get("request"), "user", None)

    def _member_of(self, user: Any) -> set[int]:
        if "member_of" not in self.context:
            self.context["member_of"] = member_tenant_ids(user)
        return self.context["member_of"]
