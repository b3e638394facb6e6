"""Settings of the deployments app, read from the environment with safe defaults.

Each is also a Django setting of the same name, so ``settings.X = …`` (and tests)
override it; nothing here needs a line in ``config/settings.py``.
"""

from typing import Any

from django.conf import settings

from config.env import env_float, env_int, env_list, env_secret, env_str

DEFAULTS: dict[str, Any] = {
    # Every Tollgate stack sharing a Docker Engine labels its containers with its own id.
    "TOLLGATE_STACK_ID": env_str("TOLLGATE_STACK_ID", "tollgate"),
    "TOLLGATE_MODEL_CACHE_VOLUME": env_str("TOLLGATE_MODEL_CACHE_VOLUME", "tollgate-model-cache"),
    "TOLLGATE_COMPILE_CACHE_VOLUME": env_str(
        "TOLLGATE_COMPILE_CACHE_VOLUME", "tollgate-compile-cache"
    ),
    # always | missing | never: "never" for air-gapped nodes whose images are preloaded.
    "TOLLGATE_PULL_POLICY": env_str("TOLLGATE_PULL_POLICY", "missing"),
    "TOLLGATE_ENGINE_READY_TIMEOUT": env_float("TOLLGATE_ENGINE_READY_TIMEOUT", 1800.0),
    "TOLLGATE_ENGINE_POLL_SECONDS": env_float("TOLLGATE_ENGINE_POLL_SECONDS", 1.0),
    "TOLLGATE_WARMUP_TIMEOUT": env_float("TOLLGATE_WARMUP_TIMEOUT", 120.0),
    "TOLLGATE_RESTART_BACKOFF_SECONDS": env_float("TOLLGATE_RESTART_BACKOFF_SECONDS", 10.0),
    "TOLLGATE_RESTART_BACKOFF_MAX_SECONDS": env_float("TOLLGATE_RESTART_BACKOFF_MAX_SECONDS", 300.0),
    "TOLLGATE_MAX_CRASHES": env_int("TOLLGATE_MAX_CRASHES", 5),
    # A replica ready this long has its crash count forgiven.
    "TOLLGATE_CRASH_RESET_SECONDS": env_float("TOLLGATE_CRASH_RESET_SECONDS", 600.0),
    "TOLLGATE_ORPHAN_GRACE_SECONDS": env_float("TOLLGATE_ORPHAN_GRACE_SECONDS", 60.0),
    "TOLLGATE_DRAIN_TIMEOUT": env_float("TOLLGATE_DRAIN_TIMEOUT", 60.0),
    "TOLLGATE_STOP_GRACE_SECONDS": env_int("TOLLGATE_STOP_GRACE_SECONDS", 30),
    "TOLLGATE_RECONCILE_SECONDS": env_float("TOLLGATE_RECONCILE_SECONDS", 5.0),
    # A running operation's worker renews its lease; a worker killed mid-operation stops
    # renewing, and after this reconcile fails the operation and takes over.
    "TOLLGATE_OPERATION_LEASE_SECONDS": env_float("TOLLGATE_OPERATION_LEASE_SECONDS", 30.0),
    # A node whose worker sent no heartbeat for this long is unreachable: its replicas
    # leave routing and unpinned ones are placed on other nodes.
    "TOLLGATE_NODE_HEARTBEAT_TIMEOUT": env_float("TOLLGATE_NODE_HEARTBEAT_TIMEOUT", 30.0),
    # How long a Ray head waits for its worker node(s) to join (and a worker for its head).
    "TOLLGATE_RAY_JOIN_TIMEOUT": env_float("TOLLGATE_RAY_JOIN_TIMEOUT", 300.0),
    # Join tokens for new nodes expire after this long.
    "TOLLGATE_JOIN_TOKEN_HOURS": env_float("TOLLGATE_JOIN_TOKEN_HOURS", 24.0),
    "TOLLGATE_TELEMETRY_TTL_SECONDS": env_int("TOLLGATE_TELEMETRY_TTL_SECONDS", 30),
    "TOLLGATE_LOG_TAIL_LINES": env_int("TOLLGATE_LOG_TAIL_LINES", 40),
    # Size of each engine's private /dev/shm (Docker's --shm-size; used only as filled).
    "TOLLGATE_ENGINE_SHM_SIZE": env_str("TOLLGATE_ENGINE_SHM_SIZE", "16g"),
    # Environment names an engine may be given (fnmatch); see engine_env.DENIED for the rest.
    "TOLLGATE_ENGINE_ENV_ALLOWED": env_list(
        "TOLLGATE_ENGINE_ENV_ALLOWED",
        ["VLLM_*", "NCCL_*", "RAY_*", "CUDA_*", "HF_HUB_*", "TORCH_*", "PYTORCH_*",
         "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "SIM_*"],
    ),
    # How weights are staged: the engine image's Hugging Face CLI.
    "TOLLGATE_STAGE_ENTRYPOINT": env_list("TOLLGATE_STAGE_ENTRYPOINT", ["hf", "download"]),
    "TOLLGATE_STAGE_TIMEOUT": env_float("TOLLGATE_STAGE_TIMEOUT", 6 * 3600.0),
}


def get(name: str) -> Any:
    """The setting ``name``: Django's value when set there, else the environment default."""
    return getattr(settings, name, DEFAULTS[name])


def hf_token() -> str:
    """The Hugging Face token (HF_TOKEN or the file HF_TOKEN_FILE names); never logged."""
    return getattr(settings, "HF_TOKEN", None) or env_secret("HF_TOKEN")
