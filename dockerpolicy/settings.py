"""What the policy allows, read once from the environment at start.

The same variables the rest of the appliance reads (``TOLLGATE_ENGINE_IMAGES``, the cache
volumes, the engine network, the stack id), so the worker and its policy agree. Nothing the
worker can write (the database, Redis) widens them: an image an admin allows through the
API must also match ``TOLLGATE_ENGINE_IMAGES`` here.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_IMAGES = (
    "vllm/vllm-openai:*",
    "nvcr.io/nvidia/vllm:*",
    "tollgate/engine-sim:*",
    "tollgate/vllm-cpu:*",
)


class SettingsError(ValueError):
    """A variable holds a value the policy cannot work with."""


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean (use true or false)")


def _list(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    return tuple(item.strip() for item in raw.split(",") if item.strip())


@dataclass(frozen=True)
class Settings:
    """The policy's configuration (see docs/reference/docker-policy.md)."""

    images: tuple[str, ...]  # fnmatch patterns, as TOLLGATE_ENGINE_IMAGES
    volumes: frozenset[str]  # the model cache and the compile cache
    networks: frozenset[str]  # the engine network
    stack: str  # containers must carry tollgate.stack=<stack>
    allow_host_network: bool  # two-box tensor parallelism (vLLM's Ray backend)
    log_allowed: bool  # one line per allowed call too, not only per refusal

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        stack = env.get("TOLLGATE_STACK_ID", "").strip() or "tollgate"
        log = env.get("TOLLGATE_DOCKER_POLICY_LOG", "").strip().lower() or "refusals"
        if log not in {"refusals", "all"}:
            raise SettingsError(f"TOLLGATE_DOCKER_POLICY_LOG={log!r}: use refusals or all")
        images = _list(env, "TOLLGATE_ENGINE_IMAGES", DEFAULT_IMAGES)
        if not images:
            raise SettingsError("TOLLGATE_ENGINE_IMAGES is empty: no engine could ever start")
        return cls(
            images=images,
            volumes=frozenset(
                {
                    env.get("TOLLGATE_MODEL_CACHE_VOLUME", "").strip() or "tollgate-model-cache",
                    env.get("TOLLGATE_COMPILE_CACHE_VOLUME", "").strip()
                    or "tollgate-compile-cache",
                }
            ),
            networks=frozenset(
                {env.get("TOLLGATE_ENGINE_NETWORK", "").strip() or "tollgate-engines"}
            ),
            stack=stack,
            allow_host_network=_bool(env, "TOLLGATE_ALLOW_HOST_NETWORK", False),
            log_allowed=log == "all",
        )
