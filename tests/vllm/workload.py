"""The mixed workload whose bill is checked against the engine's own counters: whole and
streamed requests of two tenants, streams the client cuts mid-way, requests a rate limit
refuses, and a Batch job run by the node's worker."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

import anthropic
import openai
import orjson

from tests.vllm.answers import CHAT, PROMPT
from tests.vllm.conftest import SERVED_NAME

# Tokens a cut stream could run to (the context less room for the prompt): the tiny model
# decodes hundreds of tokens a second, so a shorter answer could end before the cut.
LONG = 1900


@dataclass
class Cut:
    """One stream the client cut, and what the engine did for it (measured alone on it)."""

    tenant: str
    request_id: str
    read: int  # content events the client read
    prompt: int  # the engine's counters' growth meanwhile
    generated: int


@dataclass
class Tally:
    """What the clients saw: requests the gateway took (each one usage event), the usage
    per tenant, and the streams they cut."""

    events: int = 0
    seen: dict[str, list[int]] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)

    def add(self, tenant: str, prompt: int, completion: int) -> None:
        totals = self.seen.setdefault(tenant, [0, 0])
        totals[0] += prompt
        totals[1] += completion


def cut_chat(gw: openai.OpenAI, after: int) -> str:
    """A chat stream the client closes after ``after`` content chunks; its request id."""
    body = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": LONG, "temperature": 0}
    stream = gw.chat.completions.create(**body, stream=True)
    read = 0
    for chunk in stream:
        read += any(c.delta.content for c in chunk.choices)
        if read == after:
            break
    stream.close()
    assert read == after, "the stream ended before the client cut it"
    return stream.response.headers["x-request-id"]


def cut_completion(gw: openai.OpenAI, after: int) -> str:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
    stream = gw.completions.create(**body, stream=True)
    read = 0
    for chunk in stream:
        read += any(c.text for c in chunk.choices)
        if read == after:
            break
    stream.close()
    assert read == after, "the stream ended before the client cut it"
    return stream.response.headers["x-request-id"]


def cut_messages(ac: anthropic.Anthropic, after: int) -> str:
    body = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": LONG}
    read = 0
    with ac.messages.stream(**body, extra_body={"temperature": 0}) as stream:
        for _ in stream.text_stream:
            read += 1
            if read == after:
                break
    assert read == after, "the stream ended before the client cut it"
    return stream.response.headers["x-request-id"]


def whole_chat(gw: openai.OpenAI, tally: Tally, tenant: str, tokens: int) -> None:
    body = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": tokens, "temperature": 0}
    got = gw.chat.completions.create(**body)
    tally.events += 1
    tally.add(tenant, got.usage.prompt_tokens, got.usage.completion_tokens)


def whole_messages(ac: anthropic.Anthropic, tally: Tally, tenant: str, tokens: int) -> None:
    got = ac.messages.create(model=SERVED_NAME, messages=CHAT, max_tokens=tokens)
    tally.events += 1
    tally.add(tenant, got.usage.input_tokens, got.usage.output_tokens)


def refused_by_rate_limit(gw: openai.OpenAI, tally: Tally, tenant: str, allowed: int) -> None:
    """``allowed`` requests pass the key's requests-per-minute limit; the next is a 429 with
    Retry-After, never forwarded (the engine's counters would show it)."""
    for _ in range(allowed):
        whole_chat(gw, tally, tenant, 4)
    try:
        gw.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=4)
    except openai.RateLimitError as refused:
        assert refused.status_code == 429
        assert int(refused.response.headers["retry-after"]) >= 1
    else:
        raise AssertionError("the rate limit let a request over it through")


def batch_lines(count: int) -> bytes:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": SERVED_NAME, "messages": CHAT, "max_tokens": 5 + i},
        }
        for i in range(count)
    ]
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def run_batch(gw: openai.OpenAI, tally: Tally, tenant: str, count: int, timeout: float) -> None:
    """A Batch job through the SDK; the node's worker runs it through the gateway."""
    upload = gw.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(count))), purpose="batch")
    batch = gw.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + timeout
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout:.0f} s"
        time.sleep(0.5)
        batch = gw.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == count, batch
    for raw in gw.files.content(batch.output_file_id).text.splitlines():
        usage = orjson.loads(raw)["response"]["body"]["usage"]
        tally.events += 1
        tally.add(tenant, usage["prompt_tokens"], usage["completion_tokens"])
