"""The environment of an engine container: what an admin may add, and what it gets.

Names an admin gives must match an allow-list pattern (``TOLLGATE_ENGINE_ENV_ALLOWED``)
and never be one that changes how programs load code, where the engine listens or its
credentials. The engine then gets those, plus the Hugging Face token and offline mode
when its weights are staged on its node.
"""

import fnmatch
import re
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError

from deployments.models import Deployment, Node

NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,127}$")
# Refused whatever the allow-list says: code loading, credentials, listening address.
DENIED = [
    "LD_*",
    "PYTHON*",
    "PATH",
    "HOME",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "VLLM_API_KEY",
    "VLLM_PLUGINS",
    "VLLM_PORT",
    "VLLM_HOST",
    "VLLM_ALLOW_INSECURE_*",
    "VLLM_USE_MODELSCOPE",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",  # Tollgate's own, with --enable-lora
    "*_PROXY",
    "*_proxy",
]


def validate_engine_env(env: Any) -> dict[str, str]:
    """Normalised environment, or a ValidationError naming each refused variable."""
    if not isinstance(env, dict):
        raise ValidationError({"env": 'Give an object of variables, e.g. {"NCCL_DEBUG": "INFO"}.'})
    clean, errors = {}, []
    allowed = settings.TOLLGATE_ENGINE_ENV_ALLOWED
    for name, value in env.items():
        name = str(name)
        if not NAME_RE.match(name):
            errors.append(f"{name!r} is not a valid variable name (A-Z, 0-9, _).")
        elif any(fnmatch.fnmatchcase(name, p) for p in DENIED):
            errors.append(f"{name} cannot be set on an engine.")
        elif not any(fnmatch.fnmatchcase(name, p) for p in allowed):
            errors.append(f"{name} is not an allowed engine variable ({', '.join(allowed)}).")
        elif isinstance(value, (dict, list)) or value is None:
            errors.append(f"{name} needs a plain value.")
        elif "\n" in str(value) or "\0" in str(value) or len(str(value)) > 1024:
            errors.append(f"{name}: one line of at most 1024 characters.")
        else:
            clean[name] = str(value).lower() if isinstance(value, bool) else str(value)
    if errors:
        raise ValidationError({"env": errors})
    return clean


def engine_environment(deployment: Deployment, node: Node | None = None) -> dict[str, str]:
    """The variables an engine (or a Ray worker) of ``deployment`` starts with on ``node``."""
    env = dict(deployment.effective_env)
    token = settings.HF_TOKEN
    if token:
        env["HF_TOKEN"] = token
    # Weights staged on this node: load them from the cache without asking the Hub (engines
    # sit on an internal network with no route out).
    staged = deployment.model.staged.filter(node=node, staged_at__isnull=False)
    if node is not None and staged.exists():
        env.setdefault("HF_HUB_OFFLINE", "1")
    if deployment.serves_adapters:  # Tollgate loads and unloads tenants' adapters at run time
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env
