"""Which requests the gateway may preempt and resume exactly (gateway/preempt.py)."""

import pytest

from gateway.preempt import preemptible

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "Once upon a time"}


@pytest.mark.parametrize(
    ("endpoint", "payload", "expected"),
    [
        ("chat", CHAT, True),
        ("chat", {**CHAT, "n": 1, "stream": True}, True),
        ("chat", {**CHAT, "n": 2}, False),
        ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, False),
        ("chat", {**CHAT, "functions": [{"name": "f"}]}, False),
        ("chat", {**CHAT, "tools": []}, True),
        ("completions", TEXT, True),
        ("completions", {**TEXT, "best_of": 3}, False),
        ("completions", {**TEXT, "echo": True}, False),
        ("completions", {**TEXT, "echo": False}, True),
        ("completions", {"model": "m", "prompt": [1, 2, 3]}, False),
        ("responses", {"model": "m", "input": "hi"}, False),
        ("messages", {"model": "m", "messages": []}, False),
        ("embeddings", {"model": "m", "input": "hi"}, False),
    ],
)
def test_only_requests_that_resume_exactly_are_preemptible(
    endpoint: str, payload: dict, expected: bool
) -> None:
    assert preemptible(endpoint, payload) is expected
