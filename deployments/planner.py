"""Memory-fit arithmetic: does a deployment fit the node it is meant for?

Pure functions over plain numbers, so the console, the API and the tests show the same
sums. One replica needs its weights (parameters × bytes per parameter of the
quantization), the KV cache for ``max_model_len × max_num_seqs`` tokens and a runtime
overhead; vLLM with ``--gpu-memory-utilization`` reserves that share of the pool up front,
so a replica holds the larger of the two. On unified-memory nodes (DGX Spark) NVML
reports nothing useful: capacity is the host's available memory.
"""

import math
from dataclasses import dataclass

GB = 10**9
GIB = 2**30
KIB = 2**10

# Bytes per parameter, scales included for the block-quantized formats.
BYTES_PER_PARAM: dict[str, float] = {
    "": 2.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "nvfp4": 0.5625,
    "mxfp4": 0.53125,
    "awq": 0.5625,
    "gptq": 0.5625,
    "gguf": 0.5625,
}
KV_DTYPE_BYTES = {"auto": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
MIN_OVERHEAD = 1 * GIB
OVERHEAD_SHARE = 0.10  # activations, CUDA graphs, the CUDA context: ~10 % of the weights
DEFAULT_MAX_NUM_SEQS = 256


TENTH_GB = GB // 10


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


# Every part of the arithmetic is a whole number of tenths of a GB, as printed, so the sums
# on the page add up digit for digit: what an engine needs is rounded up, what a node
# offers is rounded down (both on the safe side).
def up(n: float) -> int:
    return -(-int(math.ceil(n)) // TENTH_GB) * TENTH_GB


def down(n: float) -> int:
    return int(n) // TENTH_GB * TENTH_GB


def estimated_kv_bytes_per_token(params_billions: float, kv_dtype_bytes: int = 2) -> int:
    """A GQA model's KV bytes per token, scaled from Llama-3-8B's 128 KiB at 16-bit.

    Grows with the square root of the size (70B-class models hold ~2.5× an 8B's), which
    is conservative for most current models; a model's exact figure overrides it.
    """
    scale = math.sqrt(max(params_billions, 0.1) / 8.0)
    return int(128 * KIB * scale * kv_dtype_bytes / 2)


@dataclass(frozen=True)
class Footprint:
    """What one replica of a deployment holds, and how that was worked out."""

    weights: int
    kv_cache: int
    overhead: int
    reserved: int  # util × pool when --gpu-memory-utilization is set, else 0
    explanation: str

    @property
    def estimate(self) -> int:
        return self.weights + self.kv_cache + self.overhead

    @property
    def per_replica(self) -> int:
        return max(self.estimate, self.reserved)


def footprint(
    params_billions: float,
    quantization: str,
    max_model_len: int,
    max_num_seqs: int,
    kv_bytes_per_token: int | None = None,
    kv_cache_dtype: str = "auto",
    gpu_memory_utilization: float | None = None,
    pool_bytes: int = 0,
    active_params_billions: float | None = None,
) -> Footprint:
    """One replica's memory, with the arithmetic spelled out for the admin."""
    per_param = BYTES_PER_PARAM.get(quantization, 2.0)
    weights = int(params_billions * 1e9 * per_param)
    kv_bytes = KV_DTYPE_BYTES.get(kv_cache_dtype, 2)
    if kv_bytes_per_token:
        per_token, source = kv_bytes_per_token * kv_bytes // 2, "from the model"
    else:
        # Mixture-of-experts models' attention scales with the active parameters.
        per_token = estimated_kv_bytes_per_token(
            active_params_billions or params_billions, kv_bytes
        )
        source = "estimated"
    tokens = max_model_len * max_num_seqs
    weights = up(weights)
    kv_cache = up(tokens * per_token)
    overhead = up(max(MIN_OVERHEAD, weights * OVERHEAD_SHARE))
    reserved = up(gpu_memory_utilization * pool_bytes) if gpu_memory_utilization else 0
    text = (
        f"weights {params_billions:g} B params × {per_param:g} bytes ({quantization or 'bf16'}) "
        f"= {gb(weights)} + KV cache {max_model_len} tokens × {max_num_seqs} seqs × "
        f"{per_token / KIB:.0f} KiB/token ({source}) = {gb(kv_cache)} + runtime overhead "
        f"{gb(overhead)} = {gb(weights + kv_cache + overhead)}"
    )
    if reserved:
        held = max(weights + kv_cache + overhead, reserved)
        text += (
            f"; --gpu-memory-utilization {gpu_memory_utilization:g} × {gb(pool_bytes)} "
            f"reserves {gb(reserved)}, so a replica holds the larger, {gb(held)}"
        )
    return Footprint(weights, kv_cache, overhead, reserved, text)


@dataclass(frozen=True)
class Capacity:
    """What a node can give engines, and where the figure came from."""

    usable: int
    explanation: str


def capacity(
    total_memory: int,
    available_memory: int,
    gpu_memory: int,
    unified: bool,
    held_by_running_engines: int = 0,
) -> Capacity:
    """The memory engines on a node may use in all (0 when unknown)."""
    gpu_memory, total_memory = down(gpu_memory), down(total_memory)
    available_memory, held_by_running_engines = (
        down(available_memory),
        down(held_by_running_engines),
    )
    if gpu_memory and not unified:
        return Capacity(gpu_memory, f"GPU memory {gb(gpu_memory)}")
    if available_memory:
        # MemAvailable already lacks what running engines hold; count it back once.
        usable = min(
            total_memory or available_memory + held_by_running_engines,
            available_memory + held_by_running_engines,
        )
        return Capacity(
            usable,
            f"available host memory {gb(available_memory)} + {gb(held_by_running_engines)} "
            f"held by Tollgate's running engines = {gb(available_memory + held_by_running_engines)}"
            + (
                f", at most the host's {gb(total_memory)}"
                if usable < available_memory + held_by_running_engines
                else ""
            ),
        )
    return Capacity(total_memory, f"host memory {gb(total_memory)}")


@dataclass(frozen=True)
class FitResult:
    fits: bool
    message: str


def check_fit(need: Footprint, replicas: int, others: int, node: str, cap: Capacity) -> FitResult:
    """Whether ``replicas`` × ``need`` plus what other engines hold fits ``cap``."""
    if need.reserved and need.estimate > need.reserved:
        return FitResult(
            False,
            (
                f"Does not fit: {need.explanation}; the engine needs {gb(need.estimate)} but its "
                f"--gpu-memory-utilization gives it only {gb(need.reserved)}."
            ),
        )
    others = up(others)
    total = need.per_replica * replicas + others
    sums = (
        f"{need.explanation}; {gb(need.per_replica)} per replica × {replicas} = "
        f"{gb(need.per_replica * replicas)}, + {gb(others)} other engines on {node} hold = "
        f"{gb(total)}"
    )
    if not cap.usable:
        return FitResult(True, f"{sums}; {node}'s memory is unknown, not checked.")
    if total > cap.usable:
        return FitResult(False, f"Does not fit: {sums} > {gb(cap.usable)} ({cap.explanation}).")
    return FitResult(True, f"Fits: {sums} ≤ {gb(cap.usable)} ({cap.explanation}).")
