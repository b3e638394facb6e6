"""Prometheus text exposition of vLLM's `vllm:*` metrics, written by hand (stdlib only)."""

from __future__ import annotations

import time
from bisect import bisect_left

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort", "error")
WAITING_BY_REASON_HELP = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
    "blocked status). Sum of all reasons equals vllm:num_requests_waiting."
)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def go_float(value: float) -> str:
    """A float as prometheus_client writes it: Go's form, 1.7958527558830974e+09 for a
    Unix time (vLLM's lora_requests_info value)."""
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM sizes its token-count histograms."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return tuple(out)
            out.append(float(v))
        exp += 1


class Histogram:
    """Cumulative-on-render histogram: observe() is one bisect and two adds."""

    __slots__ = ("name", "help", "bounds", "counts", "sum", "count")

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name, self.help, self.bounds = name, help_text, bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            acc += n
            out.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {float(acc)}')
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        out.append(f"{self.name}_count{{{labels}}} {float(self.count)}")
        out.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        return out


class Metrics:
    """Counters and histograms the engine updates; gauges are read from the engine at scrape."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.labels = f'engine="0",model_name="{model_name}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prompt_tokens_cached = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        # vLLM's PromptTokenStats sources; nothing arrives by KV transfer here.
        self.prompt_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        # Labels of vllm:cache_config_info (a subset of vLLM's CacheConfig), set by the engine.
        self.cache_info: dict[str, str] = {}
        # vllm:lora_requests_info, with --enable-lora (max_lora: --max-loras): one sample per
        # list of adapters ever seen, valued the last time it was current.
        self.max_lora: int | None = None
        self.lora_info: dict[str, float] = {}
        tok = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.req_prompt = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok
        )
        self.req_gen = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok
        )
        self.prefill_computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tok,
        )

    def _counter(self, name: str, help_text: str, value: float) -> list[str]:
        return [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} counter",
            f"{name}{{{self.labels}}} {float(value)}",
        ]

    def _gauge(self, name: str, help_text: str, value: float) -> list[str]:
        return [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} gauge",
            f"{name}{{{self.labels}}} {float(value)}",
        ]

    def stamp_lora(self, adapters: str) -> None:
        """The adapters with requests in the engine, comma-separated, are current now."""
        self.lora_info[adapters] = time.time()

    def _lora_info(self) -> list[str]:
        """vLLM names every adapter with requests in the engine under both labels, running
        and waiting alike (it lists the keys of its per-adapter counts, zeros included)."""
        name = "vllm:lora_requests_info"
        out = [f"# HELP {name} Running stats on lora requests.", f"# TYPE {name} gauge"]
        for adapters, stamp in self.lora_info.items():
            labels = (
                f'max_lora="{self.max_lora}",running_lora_adapters="{adapters}",'
                f'waiting_lora_adapters="{adapters}"'
            )
            out.append(f"{name}{{{labels}}} {go_float(stamp)}")
        return out

    def render(self, running: int, waiting: int, deferred: int, kv_usage: float) -> str:
        out: list[str] = []
        out += self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", running
        )
        out += self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting
        )
        name = "vllm:num_requests_waiting_by_reason"
        out += [
            f"# HELP {name} {WAITING_BY_REASON_HELP}",
            f"# TYPE {name} gauge",
            f'{name}{{{self.labels},reason="capacity"}} {float(waiting - deferred)}',
            f'{name}{{{self.labels},reason="deferred"}} {float(deferred)}',
        ]
        out += self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage
        )
        out += self._counter(
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            self.preemptions,
        )
        out += self._counter(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed.", self.prompt_tokens
        )
        out += self._counter(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            self.generation_tokens,
        )
        out += self._counter(
            "vllm:prompt_tokens_cached_total",
            "Number of cached prompt tokens.",
            self.prompt_tokens_cached,
        )
        out += self._counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_cache_queries,
        )
        out += self._counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_cache_hits,
        )
        # Only a KV connector (cross-instance cache sharing) moves these; vLLM always exports them.
        out += self._counter(
            "vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            0,
        )
        out += self._counter(
            "vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            0,
        )
        name = "vllm:prompt_tokens_by_source_total"
        out += [f"# HELP {name} Number of prompt tokens by source.", f"# TYPE {name} counter"]
        out += [
            f'{name}{{{self.labels},source="{src}"}} {float(n)}'
            for src, n in self.prompt_by_source.items()
        ]
        if self.cache_info:
            name = "vllm:cache_config_info"
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted({**self.cache_info, "engine": "0"}.items())
            )
            out += [
                f"# HELP {name} Information of the LLMEngine CacheConfig",
                f"# TYPE {name} gauge",
                f"{name}{{{labels}}} 1.0",
            ]
        name = "vllm:request_success_total"
        out += [
            f"# HELP {name} Count of successfully processed requests.",
            f"# TYPE {name} counter",
        ]
        out += [
            f'{name}{{{self.labels},finished_reason="{r}"}} {float(n)}'
            for r, n in self.success.items()
        ]
        if self.max_lora is not None:
            out += self._lora_info()
        for h in (
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.req_prompt,
            self.req_gen,
            self.prefill_computed,
        ):
            out += h.render(self.labels)
        return "\n".join(out) + "\n"
