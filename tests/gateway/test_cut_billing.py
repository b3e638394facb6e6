"""Billing that cannot be dodged: a stream the client cuts pays its whole prompt and exactly
the content tokens it was handed, whatever the engine reports while streaming.

Three simulator engines play three kinds of vLLM deployment: one sending running usage on
every chunk (what the gateway asks for), one ignoring ``continuous_usage_stats`` (usage
only at the end), one ignoring ``include_usage`` (no usage in streams at all). (Responses
streams carry usage only in ``response.completed`` on all three.) Each
stream is cut before its first token (the client hangs up during prefill), after 1 and
after 5 content chunks, or read to its end. The engines pause every stream before its first
token and after its 1st and 5th (``--sim-pause-after-tokens 0,1,5``) until the test sends
SIGUSR1, so when the client hangs up nothing more is on its way, however slow the machine:
every token the client did not read was never sent to it.
"""

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest

from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import UsageRecord
from deployments.models import CatalogModel
from tests.gateway.conftest import Engine, World, add_routed_model, start_engine, stop
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
TTFT_MS = 20
PAUSES = (0, 1, 5)  # tokens after which every stream waits for the test (SIGUSR1)
REPLY_TOKENS = 30
ENGINES = {
    "running-usage": (),
    "final-usage-only": ("--sim-no-continuous-usage",),
    "no-usage": ("--sim-no-include-usage",),
}
MESSAGES = [{"role": "user", "content": "Tell me about billing that cannot be dodged."}]


def _chat_body(model: str) -> dict:
    return {"model": model, "messages": MESSAGES, "max_tokens": REPLY_TOKENS}


def _completion_body(model: str) -> dict:
    return {
        "model": model,
        "prompt": "Billing that cannot be dodged is",
        "max_tokens": REPLY_TOKENS,
    }


def _responses_body(model: str) -> dict:
    return {
        "model": model,
        "input": MESSAGES[0]["content"],
        "max_output_tokens": REPLY_TOKENS,
        "store": False,
    }


def _chat_content(event: dict) -> bool:
    choices = event.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def _completion_content(event: dict) -> bool:
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("text"))


def _messages_content(event: dict) -> bool:
    return event.get("type") == "content_block_delta" and bool(event["delta"].get("text"))


def _responses_content(event: dict) -> bool:
    return event.get("type") == "response.output_text.delta" and bool(event.get("delta"))


def _openai_usage(answer: dict) -> tuple[int, int]:
    return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]


def _input_output_usage(answer: dict) -> tuple[int, int]:
    return answer["usage"]["input_tokens"], answer["usage"]["output_tokens"]


# endpoint -> (path, body, is a content event, (prompt, completion) of a whole answer).
# Another streaming endpoint is one more line here.
ENDPOINTS: dict[str, tuple[str, Callable, Callable, Callable]] = {
    "chat": ("/v1/chat/completions", _chat_body, _chat_content, _openai_usage),
    "completions": ("/v1/completions", _completion_body, _completion_content, _openai_usage),
    "messages": ("/v1/messages", _chat_body, _messages_content, _input_output_usage),
    "responses": ("/v1/responses", _responses_body, _responses_content, _input_output_usage),
}


@dataclass
class CutEngine:
    engine: Engine
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def port(self) -> int:
        return self.engine.port

    def release(self) -> None:
        """The paused stream goes on (to its next pause)."""
        os.kill(self.proc.pid, signal.SIGUSR1)

    def running(self) -> bool:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
        return float(line.rsplit(" ", 1)[1]) > 0

    def wait_running(self, running: bool = True, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.running() != running:
            assert time.monotonic() < deadline, f"the engine never had running={running}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def cut_engines() -> Iterator[dict[str, CutEngine]]:
    started = {
        kind: start_engine(
            (f"cut-{kind}",),
            "--sim-ttft-ms",
            str(TTFT_MS),
            "--sim-decode-tps",
            "200",
            "--sim-output-tokens-min",
            str(REPLY_TOKENS),
            "--sim-output-tokens-max",
            str(REPLY_TOKENS),
            "--sim-pause-after-tokens",
            ",".join(map(str, PAUSES)),
            *flags,
        )
        for kind, flags in ENGINES.items()
    }
    yield {kind: CutEngine(engine, proc) for kind, (engine, proc) in started.items()}
    for _, proc in started.values():
        stop(proc)


async def hang_up_during_prefill(world: World, engine: CutEngine, path: str, body: dict) -> None:
    """Send the stream request and hang up while the engine holds it before its first token;
    the engine ends it (the gateway aborted it)."""
    async with httpx.AsyncClient(timeout=30) as client:
        headers = {"Authorization": f"Bearer {world.key_a}"}
        request = asyncio.create_task(client.post(world.url + path, json=body, headers=headers))
        await asyncio.to_thread(engine.wait_running)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    await asyncio.to_thread(engine.wait_running, False)


def read_then_hang_up(
    world: World,
    engine: CutEngine,
    path: str,
    body: dict,
    is_content: Callable,
    after: int | None,
) -> tuple[str, int]:
    """Read ``after`` content events (None: all of them) and close: (request id, read). The
    engine waits at each pause until released; at ``after`` the client hangs up instead."""

    def release_first_token() -> None:
        engine.wait_running()
        engine.release()

    headers = {"Authorization": f"Bearer {world.key_a}"}
    seen = 0
    releaser = threading.Thread(target=release_first_token)
    releaser.start()
    try:
        with httpx.stream("POST", world.url + path, json=body, headers=headers, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if is_content(orjson.loads(line[5:])):
                    seen += 1
                    if seen == after:
                        break
                    if seen in PAUSES:
                        engine.release()
            request_id = r.headers["x-request-id"]
    finally:
        releaser.join()
    engine.wait_running(False)  # hung up at a pause: the gateway aborted the engine's request
    return request_id, seen


def newest_event(model: CatalogModel, since: float, timeout: float = 10.0) -> UsageRecord:
    """The one usage event for ``model`` recorded after ``since`` (a request cut before its
    answer began has no request id the client saw)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [
            r
            for r in (UsageRecord.decode(f[b"e"]) for _, f in get_redis().xrange(usage_stream()))
            if r.model_id == model.pk and r.occurred_at >= since
        ]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no usage event for {model.served_name} since {since}")


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("kind", list(ENGINES))
def test_cut_streams_pay_the_prompt_and_what_was_delivered(
    world: World, cut_engines: dict[str, CutEngine], kind: str, endpoint: str
) -> None:
    engine = cut_engines[kind]
    model = add_routed_model(world, f"cut-{kind}", engine.port)
    path, make_body, is_content, whole_usage = ENDPOINTS[endpoint]
    body = make_body(model.served_name)
    # What the engine counts for this prompt and a whole reply (asked directly: not billed).
    prompt, whole = whole_usage(httpx.post(engine.url + path, json=body, timeout=30).json())
    assert whole == REPLY_TOKENS
    stream_body = {**body, "stream": True}

    since = time.time()
    asyncio.run(hang_up_during_prefill(world, engine, path, stream_body))
    event = newest_event(model, since)
    assert (event.status, event.prompt_tokens, event.completion_tokens) == (
        "client_closed",
        prompt,
        0,
    )
    assert not event.prompt_estimated

    for after in (1, 5, None):
        request_id, read = read_then_hang_up(world, engine, path, stream_body, is_content, after)
        event = usage_event(request_id, timeout=10)
        delivered = REPLY_TOKENS if after is None else after
        assert read == delivered
        assert (event.prompt_tokens, event.completion_tokens) == (prompt, delivered), after
        assert event.status == ("ok" if after is None else "client_closed")
        assert not event.prompt_estimated
