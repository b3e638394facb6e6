"""What a request used: the outcome billing and metrics read, and the engines' usage objects
read into it, one table row per API.

Every API reports the same four counts under its own names: OpenAI's chat and completions
``prompt_tokens`` / ``completion_tokens`` with ``*_details``, the Responses API
``input_tokens`` / ``output_tokens``, Anthropic's Messages ``input_tokens`` plus its cache
reads and writes. One reader reads any of them (whole answers in gateway/relay.py and
gateway/responses.py, stream events in the relay's dialects) into one ``Outcome``; what a
request is billed for it is gateway/billing.py's rule, what a dead gateway's stream had
delivered is its checkpoint here (gateway/orphans.py reads it back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

# A stream records what it delivered about this often, for the orphan reaper.
CHECKPOINT_SECONDS = 1.0


@dataclass(slots=True)
class Outcome:
    """What happened upstream, for billing and metrics."""

    http_status: int = 0
    status: str = "error"  # metering.choices.UsageStatus value
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    ttft_ms: int | None = None
    started: bool = False  # response bytes went to the client
    forwarded: bool = False  # the request was sent to an engine
    prompt_known: bool = False  # the engine reported the prompt's tokens
    prompt_estimated: bool = False  # neither the engine nor its tokenizer counted the prompt
    preemptions: int = 0  # times the gateway preempted it (the engine recomputed it after)


Reader = Callable[[dict[str, Any], Outcome], int | None]


@dataclass(frozen=True, slots=True)
class UsageShape:
    """Where one API's ``usage`` object keeps its counts, and its reader (``read``)."""

    prompt: str  # the prompt's tokens
    completion: str  # the tokens generated
    cached: str  # the prompt's tokens read from the engine's cache ...
    cached_in: str | None = None  # ... in this details object (None: beside the others)
    reasoning_in: str | None = None  # the details object counting reasoning_tokens, if any
    prompt_also: tuple[str, ...] = ()  # more of the prompt, counted beside ``prompt``
    prompt_else: str | None = None  # read when ``prompt`` is absent
    # read(usage, outcome) -> completion tokens: see reader(). Built once per shape, so a
    # stream's every chunk pays no lookups in this table.
    read: Reader = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "read", reader(self))


def reader(shape: UsageShape) -> Reader:
    """The reader of ``shape``'s usage objects: it reads the prompt (with its cached part; a
    prompt reported as none leaves what was known) and the reasoning tokens into the
    outcome, and returns the completion tokens reported (None: not reported), which the
    caller assigns: a stream counts only those it handed to the client."""
    prompt_name, completion, prompt_also, prompt_else = (
        shape.prompt,
        shape.completion,
        shape.prompt_also,
        shape.prompt_else,
    )
    cached, cached_in, reasoning_in = shape.cached, shape.cached_in, shape.reasoning_in

    def read(usage: dict[str, Any], outcome: Outcome) -> int | None:
        prompt = usage.get(prompt_name)
        if prompt is None and prompt_else is not None and prompt_name not in usage:
            prompt = usage.get(prompt_else)
        prompt = int(prompt or 0)
        if prompt_also:
            prompt += sum(int(usage.get(name) or 0) for name in prompt_also)
        if prompt > 0:
            outcome.prompt_tokens = prompt
            counts = usage if cached_in is None else usage.get(cached_in)
            if isinstance(counts, dict):
                outcome.cached_tokens = int(counts.get(cached) or 0)
        outcome.prompt_known = outcome.prompt_tokens > 0
        if reasoning_in is not None:
            counts = usage.get(reasoning_in)
            if isinstance(counts, dict):
                outcome.reasoning_tokens = int(counts.get("reasoning_tokens") or 0)
        output = usage.get(completion)
        if output is None and completion not in usage:
            return None
        return int(output or 0)

    return read


# One row per API.
CHAT = UsageShape(
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    cached_in="prompt_tokens_details",
    reasoning_in="completion_tokens_details",
)
# Pooling answers generate nothing; rerank's counts only total_tokens (all of it prompt).
POOLING = replace(CHAT, prompt_else="total_tokens")
RESPONSES = UsageShape(
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    cached_in="input_tokens_details",
    reasoning_in="output_tokens_details",
)
# Anthropic counts the input as input_tokens + cache reads + cache writes: all of it is the
# prompt billed, the cache reads as cached.
MESSAGES = UsageShape(
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    prompt_also=("cache_read_input_tokens", "cache_creation_input_tokens"),
)

# The usage shape of each endpoint's answers (gateway.app.ENDPOINTS names the endpoints).
USAGE_SHAPES = {
    "chat": CHAT,
    "completions": CHAT,
    "embeddings": POOLING,
    "rerank": POOLING,
    "score": POOLING,
    "messages": MESSAGES,
    "count_tokens": MESSAGES,
    "responses": RESPONSES,
}


def checkpoint_value(prompt: int, completion: int, cached: int, reasoning: int) -> str:
    """A stream's delivered tokens as its checkpoint keeps them (see gateway/orphans.py)."""
    return f"{prompt},{completion},{cached},{reasoning}"


def checkpoint_counts(value: bytes | None) -> tuple[int, int, int, int]:
    """(prompt, completion, cached, reasoning) from a checkpoint (none: all 0)."""
    if not value:
        return 0, 0, 0, 0
    prompt, completion, cached, reasoning = (int(x) for x in value.decode().split(","))
    return prompt, completion, cached, reasoning
