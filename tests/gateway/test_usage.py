"""Every API's usage object read by the one reader of gateway/usage.py: the prompt (with its
cached part), reasoning and completion tokens a request is billed for."""

import pytest

from gateway.usage import (
    USAGE_SHAPES,
    Outcome,
    checkpoint_counts,
    checkpoint_value,
)


@pytest.mark.parametrize(
    ("endpoint", "usage", "expected"),
    [
        (
            "chat",
            {
                "prompt_tokens": 40,
                "completion_tokens": 12,
                "total_tokens": 52,
                "prompt_tokens_details": {"cached_tokens": 32},
                "completion_tokens_details": {"reasoning_tokens": 5},
            },
            (40, 32, 5, 12),
        ),
        ("embeddings", {"prompt_tokens": 9, "total_tokens": 9}, (9, 0, 0, None)),
        # Rerank counts only total_tokens: all of it is prompt.
        ("rerank", {"total_tokens": 30}, (30, 0, 0, None)),
        (
            "responses",
            {
                "input_tokens": 70,
                "output_tokens": 20,
                "input_tokens_details": {"cached_tokens": 64},
                "output_tokens_details": {"reasoning_tokens": 8},
            },
            (70, 64, 8, 20),
        ),
        # Anthropic's input excludes the cache: reads and writes are prompt too.
        (
            "messages",
            {
                "input_tokens": 10,
                "cache_read_input_tokens": 100,
                "cache_creation_input_tokens": 50,
                "output_tokens": 7,
            },
            (160, 100, 0, 7),
        ),
        ("messages", {"input_tokens": 10}, (10, 0, 0, None)),
    ],
)
def test_each_apis_usage_is_read_into_the_same_counts(
    endpoint: str, usage: dict, expected: tuple
) -> None:
    outcome = Outcome()
    completion = USAGE_SHAPES[endpoint].read(usage, outcome)
    counts = (outcome.prompt_tokens, outcome.cached_tokens, outcome.reasoning_tokens)
    assert (*counts, completion) == expected
    assert outcome.prompt_known
    assert outcome.completion_tokens == 0  # the caller decides what was delivered


def test_a_usage_without_a_prompt_keeps_the_prompt_already_known() -> None:
    """Anthropic's final message_delta reports only the output; the prompt came earlier."""
    outcome = Outcome()
    USAGE_SHAPES["messages"].read({"input_tokens": 25, "cache_read_input_tokens": 5}, outcome)
    assert USAGE_SHAPES["messages"].read({"output_tokens": 9}, outcome) == 9
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.prompt_known) == (30, 5, True)
    outcome = Outcome()
    assert USAGE_SHAPES["chat"].read({"prompt_tokens": 0}, outcome) is None
    assert not outcome.prompt_known  # the engine said nothing of the prompt: it is counted


def test_a_checkpoint_keeps_the_delivered_counts() -> None:
    assert checkpoint_counts(checkpoint_value(40, 25, 16, 3).encode()) == (40, 25, 16, 3)
    assert checkpoint_counts(None) == (0, 0, 0, 0)
