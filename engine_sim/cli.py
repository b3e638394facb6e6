"""Command line: vLLM's `serve` flags (accepted, most ignored) plus the `--sim-*` knobs.

Every knob is also read from an environment variable `SIM_<NAME>` so an orchestrator can
configure the simulator without changing the vLLM-shaped command line; a flag wins over
the environment.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field

from engine_sim.lora import RANKS, parse_modules

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
DEFAULT_MAX_MODEL_LEN = 32768


def human_int(value: str) -> int:
    """vLLM's human-readable ints: `32k` = 32000, `32K` = 32768 (same for m/M, g/G)."""
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if not m:
        if value.strip().lower() == "auto":
            return -1
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: expected e.g. 4096, 32k or 32K")
    num, suffix = float(m.group(1)), m.group(2)
    power = {"k": 1, "m": 2, "g": 3}.get(suffix.lower(), 0)
    base = 1024 if suffix.isupper() else 1000
    return int(num * base**power)


def token_counts(value: str) -> frozenset[int]:
    """A comma-separated list of positive token counts: `1,5`."""
    try:
        counts = frozenset(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected token counts such as 1,5"
        ) from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: token counts start at 0")
    return counts


@dataclass(frozen=True)
class Knob:
    """One simulation knob: `--sim-<name>` flag and `SIM_<NAME>` env var."""

    name: str
    type: type
    default: object
    help: str


KNOBS = [
    Knob("load-seconds", float, 1.0, "time to 'load weights' before listening"),
    Knob("shards", int, 4, "checkpoint shards shown in the load progress lines"),
    Knob(
        "slow-start-seconds",
        float,
        0.0,
        "extra start-up time after loading (compile/graph capture)",
    ),
    Knob("load-fail-exit-code", int, None, "die during load with this exit code (CUDA OOM)"),
    Knob("ttft-ms", float, 20.0, "prefill time per request, fixed part"),
    Knob("ttft-per-token-ms", float, 0.05, "prefill time per uncached prompt token"),
    Knob("first-request-delay-ms", float, 0.0, "extra delay of the first request (JIT warm-up)"),
    Knob(
        "lora-load-ms",
        float,
        0.0,
        "time a LoRA adapter takes to read: load_lora_adapter answers after it, and a request on "
        "an adapter pushed out of --max-cpu-loras waits for it before its first token",
    ),
    Knob("decode-tps", float, 50.0, "decode tokens/s of one sequence running alone; 0 = no delay"),
    Knob(
        "bandwidth-alpha",
        float,
        0.15,
        "per-seq rate = decode_tps / (1 + alpha*(running-1)): memory bandwidth is shared",
    ),
    Knob("output-tokens-min", int, 16, "shortest natural reply (before max_tokens cuts)"),
    Knob("output-tokens-max", int, 128, "longest natural reply; length is picked from the prompt"),
    Knob(
        "reasoning",
        bool,
        False,
        "emit `reasoning` tokens before content (also on with --reasoning-parser)",
    ),
    Knob("reasoning-tokens", int, 16, "reasoning tokens per reply"),
    Knob(
        "tool-calls",
        bool,
        False,
        "answer with a tool call when the request has tools (implies --enable-auto-tool-choice)",
    ),
    Knob("kv-cache-tokens", int, 0, "KV cache size in tokens; 0 = max_num_seqs * max_model_len"),
    Knob("embedding-dim", int, 384, "embedding vector size (pooling runner)"),
    Knob(
        "no-continuous-usage",
        bool,
        False,
        "ignore stream_options.continuous_usage_stats, as older vLLM builds and external engines "
        "do",
    ),
    Knob(
        "no-include-usage",
        bool,
        False,
        "also ignore stream_options.include_usage (and --enable-force-include-usage): no usage in "
        "streams",
    ),
    Knob(
        "crash-after-requests", int, 0, "engine dies after this many finished requests; 0 = never"
    ),
    Knob("crash-after-seconds", float, 0.0, "engine dies this long after start-up; 0 = never"),
    Knob("crash-exit-code", int, 1, "exit code when the engine dies (vLLM sometimes exits 0)"),
    Knob(
        "crash-grace-seconds",
        float,
        1.0,
        "/health answers 503 for this long before the process exits",
    ),
    Knob(
        "hang-after-requests", int, 0, "stop answering (sockets stay open) after this many requests"
    ),
    Knob("hang-after-seconds", float, 0.0, "stop answering this long after start-up; 0 = never"),
    Knob(
        "hold",
        bool,
        False,
        "admitted sequences generate nothing until the process gets SIGUSR1 (tests look at a "
        "full batch without racing the clock)",
    ),
    Knob(
        "pause-after-tokens",
        token_counts,
        frozenset(),
        "streamed sequences pause after these many tokens (e.g. 0,1,5; 0 = after prefill, "
        "before the first byte) until the process gets SIGUSR1 (tests cut a stream at an "
        "exact token without racing the clock)",
    ),
    Knob(
        "finish-abandoned",
        bool,
        False,
        "NOT vLLM: a request whose client disconnects is not aborted; it keeps its slot and "
        "generates to its end, its output discarded (engines and proxies that finish abandoned "
        "requests; Tollgate's preemption must notice it frees no slot there)",
    ),
    Knob(
        "hold-load",
        bool,
        False,
        "loading stops before its last shard until the process gets SIGUSR1 (tests look at a "
        "loading engine without racing the clock)",
    ),
]


def _env_default(knob: Knob) -> object:
    raw = os.environ.get("SIM_" + knob.name.upper().replace("-", "_"))
    if raw is None or raw == "":
        return knob.default
    if knob.type is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        return knob.type(raw)
    except ValueError:
        sys.exit(f"engine_sim: invalid SIM_{knob.name.upper().replace('-', '_')}={raw!r}")


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    b = argparse.BooleanOptionalAction
    p.add_argument("model_tag", nargs="?", default=None, help="model name or path")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", nargs="+", action="extend", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+", action="extend", default=None)
    p.add_argument("--max-model-len", type=human_int, default=-1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    p.add_argument("--max-num-queued-reqs", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--runner", choices=["auto", "generate", "pooling", "draft"], default="auto")
    p.add_argument("--task", default=None)
    p.add_argument("--convert", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--enable-auto-tool-choice", action=b, default=False)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--enable-prompt-tokens-details", action=b, default=False)
    p.add_argument("--enable-force-include-usage", action=b, default=False)
    p.add_argument("--enable-prefix-caching", action=b, default=True)
    p.add_argument("--shutdown-timeout", type=float, default=0.0)
    # LoRA adapters (engine_sim/lora.py): --max-loras different adapters run at once (a
    # request on another waits), --max-cpu-loras stay read (others are read again on use).
    p.add_argument("--enable-lora", action=b, default=False)
    p.add_argument("--max-lora-rank", type=int, choices=RANKS, default=16)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--lora-modules", nargs="+", action="extend", default=None)
    # Accepted for compatibility, no effect on a simulator.
    for flag in (
        "--dtype",
        "--seed",
        "--quantization",
        "--load-format",
        "--download-dir",
        "--tokenizer",
        "--tokenizer-mode",
        "--revision",
        "--generation-config",
        "--uvicorn-log-level",
        "--kv-cache-dtype",
        "--gpu-memory-utilization",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--distributed-executor-backend",
        "--chat-template",
        "--hf-overrides",
        "--limit-mm-per-prompt",
        "--compilation-config",
        "--swap-space",
        "--cpu-offload-gb",
        "--max-logprobs",
        "--root-path",
        "--allowed-origins",
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--nnodes",
        "--node-rank",
        "--speculative-config",
        "--override-generation-config",
        "--config",
        "--log-config-file",
        "--middleware",
        "-O",
    ):
        p.add_argument(flag, default=None)
    for flag in (
        "--trust-remote-code",
        "--trust-request-chat-template",
        "--enforce-eager",
        "--disable-log-requests",
        "--enable-log-requests",
        "--disable-log-stats",
        "--disable-frontend-multiprocessing",
        "--enable-chunked-prefill",
        "--enable-request-id-headers",
        "--headless",
        "--disable-custom-all-reduce",
        "--enable-expert-parallel",
        "--disable-fastapi-docs",
        "--enable-server-load-tracking",
        "--async-scheduling",
    ):
        p.add_argument(flag, action=b, default=None)


def _add_knobs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation knobs (also env SIM_<NAME>)")
    for k in KNOBS:
        dest = "sim_" + k.name.replace("-", "_")
        if k.type is bool:
            g.add_argument(
                "--sim-" + k.name,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=_env_default(k),
                help=k.help,
            )
        else:
            g.add_argument(
                "--sim-" + k.name, dest=dest, type=k.type, default=_env_default(k), help=k.help
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_vllm_flags(p)
    _add_knobs(p)
    return p


@dataclass
class Config:
    """Everything the simulator needs, resolved from flags and environment."""

    model: str
    served_names: list[str]
    host: str
    port: int
    api_keys: list[str]
    max_model_len: int
    max_num_seqs: int
    max_num_queued: int | None
    block_size: int
    embedding: bool
    reasoning: bool
    reasoning_details: bool
    auto_tool_choice: bool
    prompt_tokens_details: bool
    force_include_usage: bool
    prefix_caching: bool
    shutdown_timeout: float
    sim: argparse.Namespace = field(repr=False)
    scheduling_policy: str = "fcfs"
    scoring: bool = False  # a cross-encoder: /score and /rerank only
    responses_store: bool = (
        False  # VLLM_ENABLE_RESPONSES_API_STORE: /v1/responses keeps what it answered
    )
    # LoRA: adapters named at start (name -> path), their rank limit, and whether they may
    # be loaded and unloaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 16
    runtime_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int = 1  # --max-cpu-loras, else --max-loras


# Model names of cross-encoders: vLLM reads `*ForSequenceClassification` from the model's
# config; the simulator has no config, so the name stands in for it (BAAI/bge-reranker-v2-m3,
# Qwen/Qwen3-Reranker-0.6B, jinaai/jina-reranker-v2-base-multilingual, ...).
_RERANKER_NAME = re.compile(r"rerank|cross-encoder", re.IGNORECASE)


def _is_scoring(a: argparse.Namespace, model: str) -> bool:
    """A cross-encoder: `--convert classify` (how vLLM turns a causal LM such as
    Qwen3-Reranker into a scorer), the older `--task score|classify`, or a pooling runner on
    a reranker model."""
    if a.convert == "classify" or a.task in ("score", "classify", "classification"):
        return True
    return a.runner == "pooling" and a.convert != "embed" and bool(_RERANKER_NAME.search(model))


def _is_embedding(a: argparse.Namespace) -> bool:
    return a.runner == "pooling" or a.task in ("embed", "embedding") or a.convert == "embed"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse(argv: list[str] | None = None) -> Config:
    p = build_parser()
    a = p.parse_args(argv)
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        # vLLM refuses this combination at start-up, before loading anything.
        p.exit(
            1,
            "ValueError: When `--enable-auto-tool-choice` is set, `--tool-call-parser` must be "
            "set\n",
        )
    _check_lora(p, a)
    model = a.model_tag or a.model or DEFAULT_MODEL
    max_len = a.max_model_len if a.max_model_len > 0 else DEFAULT_MAX_MODEL_LEN
    scoring = _is_scoring(a, model)
    return Config(
        model=model,
        served_names=a.served_model_name or [model],
        host=a.host,
        port=a.port,
        api_keys=a.api_key or [],
        max_model_len=max_len,
        max_num_seqs=max(1, a.max_num_seqs),
        max_num_queued=a.max_num_queued_reqs,
        block_size=max(1, a.block_size),
        embedding=not scoring and _is_embedding(a),
        reasoning=bool(a.sim_reasoning or a.reasoning_parser),
        reasoning_details=bool(a.reasoning_parser),
        auto_tool_choice=bool(a.enable_auto_tool_choice or a.sim_tool_calls),
        prompt_tokens_details=a.enable_prompt_tokens_details,
        force_include_usage=a.enable_force_include_usage,
        prefix_caching=a.enable_prefix_caching,
        shutdown_timeout=a.shutdown_timeout,
        sim=a,
        scheduling_policy=a.scheduling_policy,
        scoring=scoring,
        responses_store=_env_flag("VLLM_ENABLE_RESPONSES_API_STORE"),
        enable_lora=a.enable_lora,
        lora_modules=parse_modules(a.lora_modules or []) if a.enable_lora else {},
        max_lora_rank=a.max_lora_rank,
        runtime_lora=_env_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
        max_loras=a.max_loras,
        max_cpu_loras=a.max_loras if a.max_cpu_loras is None else a.max_cpu_loras,
    )


def _check_lora(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """vLLM's LoRAConfig checks, which stop it at start-up."""
    if a.max_loras < 1:
        p.exit(1, "max_loras: Input should be greater than or equal to 1\n")
    if a.max_cpu_loras is not None and a.max_cpu_loras < a.max_loras:
        p.exit(
            1,
            f"ValueError: max_cpu_loras ({a.max_cpu_loras}) must be >= max_loras "
            f"({a.max_loras}).\n",
        )
