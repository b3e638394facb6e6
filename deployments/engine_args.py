"""The allow-list of ``vllm serve`` flags a deployment may set, and their validation.

Engine arguments are stored as ``{"flag-name": value}`` and turned into argv only here.
Flags that open files, change where the server listens or its credentials are set by
Tollgate itself and can never come from a user.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError

# The ranks vLLM 0.32 accepts for --max-lora-rank (its default: 16).
LORA_RANKS = ("1", "8", "16", "32", "64", "128", "256", "320", "512")
TOKEN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
SIZE_RE = re.compile(r"^([0-9]+)([kKmM]?)\Z")

# Set by Tollgate when it starts an engine; never from user input.
RESERVED = {
    "lora-modules": "Adapters are loaded by Tollgate from its catalogue (Adapters page).",
    "host": "Tollgate binds engines itself.",
    "port": "Tollgate assigns engine ports itself.",
    "api-key": "Engines sit on Tollgate's internal network; tenants authenticate at the gateway.",
    "served-model-name": "Set from the catalogue model's served name.",
    "model": "Set from the catalogue model's source.",
    "chat-template": "Reads a file on the engine host.",
    "download-dir": "Weights live in the shared model cache.",
    "ssl-keyfile": "Reads a file on the engine host.",
    "ssl-certfile": "Reads a file on the engine host.",
    "allowed-local-media-path": "Reads files on the engine host.",
}
GATED = {"trust-remote-code": "Only for models an admin marked 'trust remote code'."}


@dataclass(frozen=True)
class Flag:
    """How one flag's value is checked and rendered."""

    check: Callable[[Any], Any]
    help: str


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError("expects true or false")


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        whole = isinstance(value, (int, str)) and not isinstance(value, bool)
        if not (whole and str(value).isascii() and str(value).isdigit()):
            raise ValueError(f"expects a whole number from {lo} to {hi}")
        number = int(value)
        if not lo <= number <= hi:
            raise ValueError(f"expects a whole number from {lo} to {hi}")
        return number

    return check


def _float(lo: float, hi: float) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expects a number from {lo} to {hi}") from None
        if isinstance(value, bool) or not lo <= number <= hi:
            raise ValueError(f"expects a number from {lo} to {hi}")
        return number

    return check


def _choice(*options: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expects one of {', '.join(options)}")
        return value

    return check


def _token(value: Any) -> str:
    if not isinstance(value, str) or not TOKEN_RE.match(value):
        raise ValueError("expects a plain name (letters, digits, _ . : -)")
    return value


def _rank(value: Any) -> int:
    if isinstance(value, bool) or str(value) not in LORA_RANKS:
        raise ValueError(f"expects one of {', '.join(LORA_RANKS)}")
    return int(value)


def _size(value: Any) -> int:
    """vLLM accepts 32768 or 32k / 1M; stored as the number of tokens."""
    match = SIZE_RE.match(str(value)) if not isinstance(value, bool) else None
    if not match:
        raise ValueError("expects a token count such as 32768 or 32k")
    number = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
    if not 16 <= number <= 16 * 1024 * 1024:
        raise ValueError("expects a token count from 16 to 16M")
    return number


ALLOWED: dict[str, Flag] = {
    "max-model-len": Flag(_size, "Context length served (tokens)."),
    "gpu-memory-utilization": Flag(_float(0.05, 0.98), "Share of (unified) memory vLLM may take."),
    "max-num-seqs": Flag(_int(1, 4096), "Sequences decoded at once per replica."),
    "max-num-batched-tokens": Flag(_int(16, 1_048_576), "Tokens per scheduler step."),
    "enforce-eager": Flag(_bool, "Skip CUDA graph capture (faster start, slower decode)."),
    "enable-prefix-caching": Flag(_bool, "Reuse KV cache for shared prompt prefixes."),
    "kv-cache-dtype": Flag(_choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), "KV-cache precision."),
    "dtype": Flag(_choice("auto", "half", "float16", "bfloat16", "float32"), "Weight dtype."),
    "quantization": Flag(_token, "Quantization method when not in the checkpoint config."),
    "tensor-parallel-size": Flag(_int(1, 16), "GPUs (or boxes) one replica spans."),
    "pipeline-parallel-size": Flag(_int(1, 16), "Pipeline stages."),
    "distributed-executor-backend": Flag(_choice("ray", "mp"), "Multi-GPU/multi-node backend."),
    "reasoning-parser": Flag(_token, "Parser that splits reasoning from the answer."),
    "enable-auto-tool-choice": Flag(_bool, "Let the model choose tools (needs tool-call-parser)."),
    "tool-call-parser": Flag(_token, "Parser for the model's tool-call format."),
    "enable-prompt-tokens-details": Flag(_bool, "Report cached prompt tokens in usage."),
    "enable-force-include-usage": Flag(_bool, "Always send usage in streams."),
    "shutdown-timeout": Flag(_int(0, 3600), "Seconds to drain in-flight requests on stop."),
    "load-format": Flag(_choice("auto", "safetensors", "pt", "gguf", "dummy"), "How weights load."),
    "seed": Flag(_int(0, 2**31 - 1), "Random seed."),
    "max-num-queued-reqs": Flag(_int(1, 1_000_000), "Queue length before 503."),
    "scheduling-policy": Flag(_choice("fcfs", "priority"), "Queue order; priority may preempt."),
    "runner": Flag(_choice("auto", "generate", "pooling"), "Generation or pooling (embeddings)."),
    "swap-space": Flag(_float(0, 1024), "CPU swap space per GPU (GiB)."),
    "cpu-offload-gb": Flag(_float(0, 1024), "Weights offloaded to CPU memory (GiB)."),
    "generation-config": Flag(_choice("auto", "vllm"), "Where sampling defaults come from."),
    "trust-remote-code": Flag(_bool, GATED["trust-remote-code"]),
    "trust-request-chat-template": Flag(
        _bool,
        "Render a request's own chat template (the engine shield still refuses it unless the "
        "model allows chat_template).",
    ),
    # LoRA adapters (deployments/adapters.py loads them at run time; never --lora-modules,
    # which names paths).
    "enable-lora": Flag(_bool, "Serve tenants' LoRA adapters on this base model."),
    "max-loras": Flag(_int(1, 256), "Adapters in one batch (GPU slots)."),
    "max-cpu-loras": Flag(_int(1, 4096), "Adapters kept loaded per replica (default: max-loras)."),
    "max-lora-rank": Flag(_rank, "Largest adapter rank served (vLLM's default: 16)."),
}


def validate_engine_args(args: Any, trust_remote_code_allowed: bool = False) -> dict[str, Any]:
    """Normalised engine arguments, or a ValidationError naming each bad flag."""
    if not isinstance(args, dict):
        raise ValidationError({"engine_args": 'Give an object of flags, e.g. {"max-num-seqs": 4}.'})
    clean, errors = {}, []
    for raw_name, value in args.items():
        name = str(raw_name).removeprefix("--")
        if name in RESERVED:
            errors.append(f"--{name} cannot be set: {RESERVED[name]}")
        elif name not in ALLOWED:
            errors.append(f"--{name} is not an allowed engine flag.")
        elif name == "trust-remote-code" and value and not trust_remote_code_allowed:
            errors.append(f"--{name}: {GATED[name]}")
        else:
            try:
                clean[name] = ALLOWED[name].check(value)
            except ValueError as exc:
                errors.append(f"--{name} {exc}.")
    lora = [name for name in ("max-loras", "max-cpu-loras", "max-lora-rank") if name in clean]
    if lora and not clean.get("enable-lora"):
        errors.append(f"--{lora[0]} needs --enable-lora.")
    if clean.get("max-cpu-loras", 10**6) < clean.get("max-loras", 1):
        errors.append("--max-cpu-loras must be at least --max-loras (vLLM exits otherwise).")
    if clean.get("enable-auto-tool-choice") and "tool-call-parser" not in clean:
        errors.append("--enable-auto-tool-choice needs --tool-call-parser (vLLM exits without it).")
    if errors:
        raise ValidationError({"engine_args": errors})
    return clean


def to_argv(args: dict[str, Any]) -> list[str]:
    """The validated flags as ``vllm serve`` argv (booleans become bare flags)."""
    argv: list[str] = []
    for name, value in args.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is False:
            if name == "enable-prefix-caching":
                argv.append("--no-enable-prefix-caching")
        else:
            argv += [f"--{name}", str(value)]
    return argv
