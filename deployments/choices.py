"""Names of model tasks, node, deployment, replica and operation states."""

from django.db import models


class Task(models.TextChoices):
    GENERATE = "generate", "Chat / completion"
    EMBED = "embed", "Embedding"
    SCORE = "score", "Rerank / score (cross-encoder)"


class Visibility(models.TextChoices):
    PUBLIC = "public", "Public: every tenant"
    PRIVATE = "private", "Private: granted tenants only"


class Quantization(models.TextChoices):
    NONE = "", "None (checkpoint dtype)"
    BF16 = "bf16", "BF16"
    FP16 = "fp16", "FP16"
    FP8 = "fp8", "FP8"
    NVFP4 = "nvfp4", "NVFP4"
    MXFP4 = "mxfp4", "MXFP4"
    AWQ = "awq", "AWQ (4-bit)"
    GPTQ = "gptq", "GPTQ (4-bit)"
    INT8 = "int8", "INT8"
    GGUF = "gguf", "GGUF"


class Arch(models.TextChoices):
    ARM64 = "arm64", "arm64"
    AMD64 = "amd64", "amd64"


class NodeStatus(models.TextChoices):
    ONLINE = "online", "Online"
    UNREACHABLE = "unreachable", "Unreachable"
    DRAINING = "draining", "Draining"
    DISABLED = "disabled", "Disabled"
    REVOKED = "revoked", "Revoked"


class ContainerRole(models.TextChoices):
    """The ``tollgate.role`` label: what a container Tollgate created is for."""

    ENGINE = "engine", "Engine"
    HEAD = "head", "Ray head + engine"
    WORKER = "worker", "Ray worker"
    STAGE = "stage", "Weight staging helper"


class DesiredState(models.TextChoices):
    RUNNING = "running", "Running"
    STOPPED = "stopped", "Stopped"


class DeploymentMode(models.TextChoices):
    """When a deployment's replicas run: all the time, or only while it is being used."""

    ALWAYS = "always", "Always running"
    ON_DEMAND = "on_demand", "On demand"


class DeploymentState(models.TextChoices):
    """What the reconciler observed for the deployment as a whole."""

    PENDING = "pending", "Pending"
    DEPLOYING = "deploying", "Deploying"
    READY = "ready", "Ready"
    DEGRADED = "degraded", "Degraded"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"


class ReplicaState(models.TextChoices):
    PENDING = "pending", "Pending"
    PULLING = "pulling", "Pulling image"
    STARTING = "starting", "Starting container"
    LOADING = "loading", "Loading weights"
    WARMING = "warming", "Warming up"
    READY = "ready", "Ready"
    DRAINING = "draining", "Draining"
    STOPPED = "stopped", "Stopped"
    CRASHED = "crashed", "Crashed"
    FAILED = "failed", "Failed"


class OperationKind(models.TextChoices):
    DEPLOY = "deploy", "Deploy"
    SCALE = "scale", "Scale"
    STOP = "stop", "Stop"
    RESTART = "restart", "Restart"
    REMOVE = "remove", "Remove"
    PULL = "pull", "Pull image"
    STAGE = "stage", "Stage weights"
    CHECK_ADAPTER = "check_adapter", "Check adapter"
    WORKER_START = "worker_start", "Start Ray worker"
    WORKER_STOP = "worker_stop", "Stop Ray worker"
    WAKE = "wake", "Start on demand"


class AdapterStatus(models.TextChoices):
    CHECKING = "checking", "Checking"
    READY = "ready", "Ready"
    FAILED = "failed", "Failed its check"


class OperationStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
