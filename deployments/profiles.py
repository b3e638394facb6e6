"""Built-in engine profiles: known-good defaults per kind of hardware.

Admins add their own through the API; these are created by a data migration and kept
as the reference (``builtin=True``).
"""

from typing import Any

# vLLM's plain release tags are CUDA 13 since v0.20 and multi-arch (arm64 for GB10/sm_121).
DGX_SPARK_IMAGE = "vllm/vllm-openai:v0.33.0"
SIMULATOR_IMAGE = "tollgate/engine-sim:latest"

BUILTIN_PROFILES: list[dict[str, Any]] = [
    {
        "name": "dgx-spark",
        "description": (
            "NVIDIA DGX Spark (GB10, 128 GB unified memory): CUDA 13 arm64 vLLM image; "
            "0.80 of the ~121.7 GiB unified pool so the OS keeps room; 4 sequences at once "
            "(more costs per-token bandwidth); prefix caching on."
        ),
        "image": DGX_SPARK_IMAGE,
        "engine_args": {
            "gpu-memory-utilization": 0.8,
            "max-num-seqs": 4,
            "enable-prefix-caching": True,
            "enable-prompt-tokens-details": True,
            "shutdown-timeout": 30,
        },
        "env": {},
    },
    {
        "name": "simulator",
        "description": (
            "Tollgate's vLLM-API simulator: no GPU, no weights; for demos, CI and benchmarks."
        ),
        "image": SIMULATOR_IMAGE,
        "engine_args": {"max-num-seqs": 8, "max-model-len": 8192, "enable-prefix-caching": True},
        "env": {},
    },
]


def ensure_builtin_profiles() -> None:
    """Create or refresh the built-in profiles (the data migration does this on install)."""
    from deployments.models import EngineProfile

    for profile in BUILTIN_PROFILES:
        EngineProfile.objects.update_or_create(
            name=profile["name"], defaults={**profile, "builtin": True}
        )
