"""The model catalogue, Docker nodes, deployments (desired state), replicas and operations."""

from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from core.fields import EncryptedTextField
from core.request_fields import validate_allowed_fields
from deployments.choices import (
    AdapterStatus,
    Arch,
    DeploymentMode,
    DeploymentState,
    DesiredState,
    NodeStatus,
    OperationKind,
    OperationStatus,
    Quantization,
    ReplicaState,
    Task,
    Visibility,
)

# What an admin sets, one list per model: the admin API's serializers write these fields, the
# console's forms show them (or some of them), the services change them and the audit log
# records them (tenants.audit.snapshot; the upstream key only as set or changed).
MODEL_FIELDS = (
    "served_name",
    "source",
    "revision",
    "task",
    "params_billions",
    "active_params_billions",
    "quantization",
    "context_length",
    "visibility",
    "trust_remote_code",
    "kv_bytes_per_token",
    "allowed_request_fields",
    "description",
)
NODE_FIELDS = (
    "name",
    "docker_url",
    "queue",
    "engine_host",
    "arch",
    "gpu_description",
    "gpu_count",
    "total_memory_bytes",
    "gpu_memory_bytes",
    "unified_memory",
    "memory_limit_bytes",
    "high_speed_interface",
    "high_speed_address",
    "status",
)
DEPLOYMENT_FIELDS = (
    "name",
    "model",
    "node",
    "worker_node",
    "profile",
    "image",
    "engine_args",
    "env",
    "external",
    "external_url",
    "upstream_key",
    "replicas",
    "cpus",
    "mode",
    "idle_timeout_seconds",
    "start_timeout_seconds",
)
ADAPTER_FIELDS = (
    "served_name",
    "base",
    "tenant",
    "visibility",
    "source",
    "pinned",
    "description",
)
PROFILE_FIELDS = ("name", "description", "image", "engine_args", "env", "cpu_headroom")
ALLOWED_IMAGE_FIELDS = ("pattern", "note")

served_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$",
    "Use letters, digits and . _ : / - (max 128 characters), starting with a letter or digit.",
)
source_validator = RegexValidator(
    r"^(?:[A-Za-z0-9][\w.-]*/[\w.-]+|/(?!.*\.\.)[\w./-]+)$",
    "Give a Hugging Face repo id (org/name) or an absolute path inside the model cache.",
)


class CatalogModel(models.Model):
    """A model tenants can call by its served name, and how to load it."""

    served_name = models.CharField(max_length=128, unique=True, validators=[served_name_validator])
    source = models.CharField(max_length=255, validators=[source_validator])
    revision = models.CharField(max_length=64, blank=True)
    task = models.CharField(max_length=16, choices=Task, default=Task.GENERATE)
    params_billions = models.DecimalField(
        max_digits=8,
        decimal_places=2,
        validators=[MinValueValidator(0)],
        help_text="Total parameters, in billions.",
    )
    active_params_billions = models.DecimalField(
        max_digits=8,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Active parameters per token for mixture-of-experts models, in billions.",
    )
    quantization = models.CharField(max_length=8, choices=Quantization, blank=True, default="")
    context_length = models.PositiveIntegerField(validators=[MinValueValidator(16)])
    visibility = models.CharField(max_length=8, choices=Visibility, default=Visibility.PUBLIC)
    granted_tenants = models.ManyToManyField(
        "tenants.Tenant", through="ModelGrant", blank=True, related_name="granted_models"
    )
    trust_remote_code = models.BooleanField(
        default=False, help_text="Admin allow-list: engines may run this model's own code."
    )
    kv_bytes_per_token = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="KV-cache bytes per token (2 × layers × KV heads × head dim × 2 bytes); "
        "estimated from the parameter count when empty.",
    )
    allowed_request_fields = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_allowed_fields],
        help_text="Request fields the engine shield refuses from tenants that this model "
        "accepts (docs/admins/engine-shield.md): chat_template, chat_template_kwargs, "
        "chat_template_kwargs.<key>, mm_processor_kwargs, media_io_kwargs, vllm_xargs, "
        "session_id.",
    )
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["served_name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.served_name


class ModelGrant(models.Model):
    """Permission for one tenant to use one private model."""

    model = models.ForeignKey(CatalogModel, on_delete=models.CASCADE, related_name="grants")
    tenant = models.ForeignKey(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="model_grants"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["model", "tenant"], name="modelgrant_unique_model_tenant"
            )
        ]

    def __str__(self) -> str:
        return f"{self.model} → {self.tenant}"


class Adapter(models.Model):
    """A LoRA adapter tenants call by its served name, served by the engines of its base."""

    served_name = models.CharField(max_length=128, unique=True, validators=[served_name_validator])
    base = models.ForeignKey(CatalogModel, on_delete=models.PROTECT, related_name="adapters")
    # The tenant whose adapter it is (its admins manage it); empty: the platform's own.
    tenant = models.ForeignKey(
        "tenants.Tenant",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="adapters",
    )
    visibility = models.CharField(max_length=8, choices=Visibility, default=Visibility.PRIVATE)
    granted_tenants = models.ManyToManyField(
        "tenants.Tenant", through="AdapterGrant", blank=True, related_name="granted_adapters"
    )
    source = models.CharField(
        max_length=255,
        validators=[source_validator],
        help_text="A Hugging Face repo id staged in the model cache, or a folder in it.",
    )
    rank = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="LoRA rank r, from its adapter_config.json."
    )
    target_modules = models.JSONField(default=list, blank=True)
    pinned = models.BooleanField(
        default=False, help_text="Kept loaded on every replica of its base, not only when used."
    )
    description = models.TextField(blank=True)
    # Its files are checked on a node (adapter_config.json, safetensors only, rank and target
    # modules the base's deployments serve) before any tenant can call it.
    status = models.CharField(max_length=16, choices=AdapterStatus, default=AdapterStatus.CHECKING)
    status_message = models.TextField(blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    checked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["served_name"]

    def __str__(self) -> str:
        return self.served_name


class AdapterGrant(models.Model):
    """Permission for one more tenant to use a private adapter."""

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="grants")
    tenant = models.ForeignKey(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="adapter_grants"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["adapter", "tenant"], name="adaptergrant_unique_adapter_tenant"
            )
        ]

    def __str__(self) -> str:
        return f"{self.adapter} → {self.tenant}"


class Node(models.Model):
    """A Docker host that runs engines; its Celery worker consumes ``queue``."""

    name = models.SlugField(max_length=64, unique=True)
    docker_url = models.CharField(max_length=255, help_text="e.g. tcp://docker-proxy:2375")
    # The Celery queue whose worker drives this node's Docker: node.<name> for a box with
    # its own worker, the control plane's joined-node queue (shared) for a joined node.
    queue = models.CharField(max_length=100)
    engine_host = models.CharField(
        max_length=255, blank=True, help_text="Address the gateway reaches this node's engines at."
    )
    arch = models.CharField(max_length=8, choices=Arch, default=Arch.ARM64)
    gpu_description = models.CharField(max_length=200, blank=True)
    gpu_count = models.PositiveSmallIntegerField(default=0)
    total_memory_bytes = models.PositiveBigIntegerField(default=0)
    unified_memory = models.BooleanField(
        default=False, help_text="GPU and CPU share one memory pool (e.g. DGX Spark)."
    )
    gpu_memory_bytes = models.PositiveBigIntegerField(
        default=0, help_text="Dedicated GPU memory in total (0 on unified-memory nodes)."
    )
    available_memory_bytes = models.PositiveBigIntegerField(
        default=0, help_text="Host MemAvailable at the last heartbeat."
    )
    cpu_count = models.PositiveSmallIntegerField(default=0)
    memory_limit_bytes = models.PositiveBigIntegerField(
        default=0, help_text="At most this much memory for engines on this node (0: no limit)."
    )
    high_speed_interface = models.CharField(
        max_length=32,
        blank=True,
        validators=[RegexValidator(r"^[A-Za-z0-9_.:-]*$")],
        help_text="Interconnect NIC for multi-node engines (NCCL_SOCKET_IFNAME), e.g. enp1s0f1np1.",
    )
    high_speed_address = models.GenericIPAddressField(
        null=True,
        blank=True,
        help_text="This node's IP on the interconnect (VLLM_HOST_IP); empty: engine_host.",
    )
    docker_version = models.CharField(max_length=64, blank=True)
    status = models.CharField(max_length=16, choices=NodeStatus, default=NodeStatus.ONLINE)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    credential_hash = models.CharField(
        max_length=64,
        blank=True,
        editable=False,
        help_text="SHA-256 of the joined node's Redis password (what Redis itself keeps).",
    )
    credential_issued_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def cluster_address(self) -> str:
        """Where the other nodes of a tensor-parallel group reach this one."""
        return self.high_speed_address or self.engine_host


class JoinToken(models.Model):
    """A one-time secret a new node presents to claim its Node row (only its hash is kept)."""

    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    node_name = models.SlugField(max_length=64)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="join_tokens"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"join {self.node_name} ({self.prefix})"


class Deployment(models.Model):
    """What should run: a model on a node with an engine image, arguments and replicas."""

    name = models.SlugField(max_length=64, unique=True)
    model = models.ForeignKey(CatalogModel, on_delete=models.PROTECT, related_name="deployments")
    node = models.ForeignKey(
        Node,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="deployments",
        help_text="Empty: Tollgate places replicas on the node with the most free memory.",
    )
    worker_node = models.ForeignKey(
        Node,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="worker_deployments",
        help_text="Two-box tensor parallelism: the node running the Ray worker "
        "(empty: Tollgate picks one).",
    )
    profile = models.ForeignKey(
        "EngineProfile",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="deployments",
        help_text="Known-good defaults the deployment's own arguments override.",
    )
    image = models.CharField(max_length=255, blank=True)
    engine_args = models.JSONField(default=dict, blank=True)
    env = models.JSONField(
        default=dict, blank=True, help_text="Extra engine environment (allow-listed names)."
    )
    external = models.BooleanField(
        default=False, help_text="An engine Tollgate routes to but never starts or stops."
    )
    external_url = models.URLField(blank=True, help_text="Base URL of an external engine.")
    upstream_key = EncryptedTextField(
        blank=True,
        help_text="Bearer key the external engine expects (write-only, encrypted at rest).",
    )
    replicas = models.PositiveSmallIntegerField(default=1, validators=[MaxValueValidator(16)])
    cpus = models.DecimalField(
        max_digits=6,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0.1"))],
        help_text="CPU cores each engine container may use (Docker's --cpus). Empty: the "
        "node's cores minus the profile's CPU headroom, or no limit.",
    )
    desired_state = models.CharField(
        max_length=16, choices=DesiredState, default=DesiredState.RUNNING
    )
    mode = models.CharField(
        max_length=16,
        choices=DeploymentMode,
        default=DeploymentMode.ALWAYS,
        help_text="On demand: started by the first request, stopped after its idle timeout.",
    )
    idle_timeout_seconds = models.PositiveIntegerField(
        default=900,
        validators=[MinValueValidator(10), MaxValueValidator(86400)],
        help_text="On demand: unused this long, its replicas are stopped.",
    )
    start_timeout_seconds = models.PositiveIntegerField(
        default=600,
        validators=[MinValueValidator(10), MaxValueValidator(86400)],
        help_text="On demand: how long a request waits for a start before a 503.",
    )
    # On demand: whether its replicas should run now (a request woke it; the idle pass or
    # an eviction puts it back to sleep). Always-running deployments ignore it.
    awake = models.BooleanField(default=False, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    state = models.CharField(
        max_length=16, choices=DeploymentState, default=DeploymentState.PENDING
    )
    state_message = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def on_demand(self) -> bool:
        return self.mode == DeploymentMode.ON_DEMAND

    @property
    def wanted_running(self) -> bool:
        """Whether its replicas should run now: desired running, and awake if on demand."""
        if self.desired_state != DesiredState.RUNNING:
            return False
        return self.awake or not self.on_demand

    @property
    def max_num_seqs(self) -> int:
        """The engine's concurrency budget per replica (vLLM's default when not set)."""
        return int(self.effective_args.get("max-num-seqs", 256))

    @property
    def serves_adapters(self) -> bool:
        return bool(self.effective_args.get("enable-lora"))

    @property
    def adapter_slots(self) -> int:
        """Adapters kept loaded per replica: vLLM's --max-cpu-loras (default --max-loras,
        default 1); loading one more unloads the least recently used."""
        args = self.effective_args
        return int(args.get("max-cpu-loras") or args.get("max-loras") or 1)

    @property
    def max_lora_rank(self) -> int:
        return int(self.effective_args.get("max-lora-rank") or 16)

    @property
    def effective_args(self) -> dict:
        """The profile's defaults overridden by the deployment's own flags."""
        base = dict(self.profile.engine_args) if self.profile_id and self.profile else {}
        return {**base, **(self.engine_args or {})}

    @property
    def effective_env(self) -> dict:
        base = dict(self.profile.env) if self.profile_id and self.profile else {}
        return {**base, **(self.env or {})}

    def cpu_limit(self, cores: int) -> float | None:
        """CPU cores one engine container may use on a node with ``cores`` of them (Docker's
        --cpus); None: no limit.

        The deployment's own figure (at most the node's cores: Docker refuses more), else
        the node's cores minus the profile's headroom when that leaves at least one core.
        """
        if self.cpus is not None:
            return min(float(self.cpus), cores) if cores else float(self.cpus)
        headroom = self.profile.cpu_headroom if self.profile_id and self.profile else None
        if headroom is None or not cores:
            return None
        limit = cores - float(headroom)
        # A one-core box cannot share: a throttled engine there would barely decode.
        return limit if limit >= 1 else None


class Replica(models.Model):
    """One engine container of a deployment, as last observed."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    index = models.PositiveSmallIntegerField()
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas"
    )
    container_id = models.CharField(max_length=64, blank=True)
    container_name = models.CharField(max_length=128, blank=True)
    worker_node = models.ForeignKey(
        Node,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="worker_replicas",
        help_text="Tensor parallelism over two nodes: where the Ray worker container runs.",
    )
    worker_container_name = models.CharField(max_length=128, blank=True)
    host = models.CharField(max_length=255, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=ReplicaState, default=ReplicaState.PENDING)
    healthy = models.BooleanField(default=False)
    restart_count = models.PositiveIntegerField(default=0)
    crash_count = models.PositiveIntegerField(
        default=0, help_text="Crashes since the replica was last ready for a while."
    )
    next_restart_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    external_url = models.CharField(max_length=255, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment__name", "index"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "index"], name="replica_unique_index")
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}#{self.index}"

    @property
    def base_url(self) -> str:
        if self.external_url:
            # Admins paste either the server root or its OpenAI base (…/v1): accept both.
            return self.external_url.rstrip("/").removesuffix("/v1")
        return f"http://{self.host}:{self.port}" if self.host and self.port else ""


class Operation(models.Model):
    """A long-running action (deploy, stop, pull, …) and its progress, for the console."""

    kind = models.CharField(max_length=16, choices=OperationKind)
    status = models.CharField(
        max_length=16, choices=OperationStatus, default=OperationStatus.QUEUED
    )
    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.CASCADE, related_name="operations"
    )
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="operations"
    )
    model = models.ForeignKey(
        CatalogModel, null=True, blank=True, on_delete=models.CASCADE, related_name="operations"
    )
    adapter = models.ForeignKey(
        Adapter, null=True, blank=True, on_delete=models.CASCADE, related_name="operations"
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    phase = models.CharField(max_length=64, blank=True)
    progress = models.FloatField(
        default=0.0, validators=[MinValueValidator(0), MaxValueValidator(100)]
    )
    message = models.TextField(blank=True)
    error = models.TextField(blank=True)
    detail = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.status}"


class EngineProfile(models.Model):
    """Known-good engine defaults for a kind of hardware: image, flags and environment."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.TextField(blank=True)
    image = models.CharField(max_length=255)
    engine_args = models.JSONField(default=dict, blank=True)
    env = models.JSONField(default=dict, blank=True)
    cpu_headroom = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0"))],
        help_text="CPU cores kept free on the engine's node for Tollgate and the host: an "
        "engine may use the node's cores minus this (Docker's --cpus). Empty: no limit.",
    )
    cluster = models.JSONField(
        default=dict,
        blank=True,
        editable=False,
        help_text="How the image runs a multi-node (Ray) group: network, Ray port, head and "
        "worker entrypoints. Built-in profiles only: never from user input.",
    )
    builtin = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class AllowedImage(models.Model):
    """An engine image pattern an admin allowed, in addition to TOLLGATE_ENGINE_IMAGES."""

    pattern = models.CharField(
        max_length=255, unique=True, help_text="fnmatch, e.g. vllm/vllm-openai:v0.33*"
    )
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pattern"]

    def __str__(self) -> str:
        return self.pattern


class StagedModel(models.Model):
    """A model's weights present in a node's shared model cache, and their size on disk."""

    model = models.ForeignKey(CatalogModel, on_delete=models.CASCADE, related_name="staged")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="staged_models")
    revision = models.CharField(max_length=64, blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    staged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["model__served_name"]
        constraints = [
            models.UniqueConstraint(fields=["model", "node"], name="staged_unique_model_node")
        ]

    def __str__(self) -> str:
        return f"{self.model} on {self.node}"
