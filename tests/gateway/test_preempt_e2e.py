"""Preemption by the gateway on an engine that serves first come, first served: a P0
request that finds the only slot taken by a P2 stream gets it at once; the P2 client still
sees one complete, well-formed stream (same id, one role chunk, every token it asked for,
the usage of its own prompt) and is billed once for what it received.

The engine (the simulator, one slot, 25 tokens/s) generates every reply to its
``max_tokens``, so without preemption a P0 request sent while the P2 stream has 40 tokens
to go (1.6 s) would finish after it.
"""

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from gateway.tuning import note_verdict
from tenants import services as tenant_services
from tests.gateway.conftest import (
    METRICS_TOKEN,
    Engine,
    World,
    add_routed_model,
    start_engine,
    start_gateway,
    stop,
    wait_until_served,
)
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = "sim-fcfs"
REPLY = 50
MESSAGES = [{"role": "user", "content": "Tell me a long story about engine slots."}]
PROMPT = "Once upon a time an engine slot"


@dataclass
class Stream:
    """One streamed answer as its client saw it."""

    events: list[dict] = field(default_factory=list)
    done_frames: int = 0
    request_id: str = ""
    status: int = 0
    finished_at: float = 0.0

    def content_tokens(self) -> int:
        return sum(
            1
            for e in self.events
            for c in e.get("choices") or ()
            if (c.get("delta") or {}).get("content") or c.get("text")
        )


@pytest.fixture
def fcfs_model(world: World) -> Iterator[Engine]:
    engine, proc = start_engine(
        (MODEL,),
        "--sim-decode-tps",
        "25",
        "--sim-ttft-ms",
        "20",
        "--sim-output-tokens-min",
        "400",
        "--sim-output-tokens-max",
        "400",
    )
    model = add_routed_model(world, MODEL, engine.port, max_num_seqs=1)
    # Judged already: preempting frees a slot on this engine (the simulator aborts what its
    # client left, as vLLM does), so admission preempts as often as P0 needs, not once per
    # probation window (test_preempt_verdict_e2e.py shows the judging).
    note_verdict(model.pk, frees=True)
    tenant_services.grant_interactive(None, world.tenant_b, 30)  # tenant B is P0
    wait_until_served(world.url, world.key_b, MODEL)
    yield engine
    stop(proc)


async def stream(
    url: str, key: str, path: str, body: dict, into: Stream, priority: str = "P2"
) -> None:
    headers = {"Authorization": f"Bearer {key}", "X-Tollgate-Priority": priority}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{url}/v1/{path}", headers=headers, json=body) as r:
            into.status, into.request_id = r.status_code, r.headers.get("x-request-id", "")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    into.done_frames += 1
                elif line.startswith("data: "):
                    into.events.append(orjson.loads(line[6:]))
    into.finished_at = time.monotonic()


async def ask_p0(url: str, key: str) -> float:
    """A short P0 chat request; when it finished."""
    return (await timed_p0(url, key))[1]


async def timed_p0(url: str, key: str) -> tuple[float, float]:
    """A short P0 chat request; how long it took, and when it finished. One that waits for
    the P2 reply takes at least the engine's time for that reply's remaining tokens."""
    sent = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
    assert r.status_code == 200 and r.headers["x-tollgate-priority"] == "P0", r.text
    return time.monotonic() - sent, time.monotonic()


async def until_tokens(s: Stream, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while s.content_tokens() < n:
        assert time.monotonic() < deadline, f"the P2 stream never reached {n} tokens"
        await asyncio.sleep(0.01)


def prompt_tokens(engine: Engine, body: dict) -> int:
    return httpx.post(f"{engine.url}/tokenize", json=body, timeout=10).json()["count"]


def preemptions(url: str, model: str = MODEL) -> float:
    """The gateway's tollgate_preemptions_total for ``model``."""
    page = httpx.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    return sum(
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("tollgate_preemptions_total{") and f'model="{model}"' in line
    )


def assert_one_whole_stream(s: Stream, prompt: int, kind: str) -> None:
    """What the P2 client must see however often it was preempted."""
    assert s.status == 200 and s.done_frames == 1
    assert len({e["id"] for e in s.events}) == 1  # one stream, one id
    assert len({e["created"] for e in s.events}) == 1
    if kind == "chat":
        roles = [e for e in s.events for c in e["choices"] if "role" in (c.get("delta") or {})]
        assert len(roles) == 1 and s.events[0] is roles[0]
    assert s.content_tokens() == REPLY
    finishes = [c["finish_reason"] for e in s.events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    usage = [e["usage"] for e in s.events if e.get("usage")]
    assert len(usage) == 1 and s.events[-1]["choices"] == []  # one final usage chunk
    assert usage[0]["prompt_tokens"] == prompt  # the client's prompt, not the recompute
    assert usage[0]["completion_tokens"] == REPLY
    assert usage[0]["total_tokens"] == prompt + REPLY
    billed = usage_event(s.request_id)
    assert (billed.prompt_tokens, billed.completion_tokens, billed.status) == (prompt, REPLY, "ok")


CASES = {
    "chat": (
        "chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": REPLY},
        {"model": MODEL, "messages": MESSAGES},
    ),
    "completions": (
        "completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": REPLY},
        {"model": MODEL, "prompt": PROMPT},
    ),
}


@pytest.mark.parametrize("kind", CASES)
def test_p0_takes_the_slot_of_a_p2_stream_which_resumes_whole(
    world: World, fcfs_model: Engine, kind: str
) -> None:
    path, body, tokenize = CASES[kind]
    before = preemptions(world.url)

    async def scenario() -> tuple[Stream, float]:
        p2 = Stream()
        task = asyncio.create_task(
            stream(
                world.url,
                world.key_a,
                path,
                {**body, "stream": True, "stream_options": {"include_usage": True}},
                p2,
            )
        )
        await until_tokens(p2, 10)
        p0_done = await ask_p0(world.url, world.key_b)
        assert not task.done()  # the P0 answer came while the P2 stream still had to go on
        await task
        return p2, p0_done

    p2, p0_done = asyncio.run(scenario())
    assert p0_done < p2.finished_at
    assert_one_whole_stream(p2, prompt_tokens(fcfs_model, tokenize), kind)
    assert preemptions(world.url) - before == 1


def test_a_request_is_preempted_at_most_twice(world: World, fcfs_model: Engine) -> None:
    path, body, tokenize = CASES["chat"]

    async def scenario() -> tuple[Stream, list[float]]:
        p2 = Stream()
        task = asyncio.create_task(
            stream(
                world.url,
                world.key_a,
                path,
                {**body, "stream": True, "stream_options": {"include_usage": True}},
                p2,
            )
        )
        done = []
        for got in (5, 15, 25):
            await until_tokens(p2, got)  # resumed: it streams again
            done.append(await timed_p0(world.url, world.key_b))
        await task
        return p2, done

    p2, done = asyncio.run(scenario())
    # Twice the P0 answer came first; the third time the P2 stream was no longer a victim:
    # the P0 request waited for its remaining 20+ tokens (0.8 s at 25 tokens/s).
    assert done[0][1] < p2.finished_at and done[1][1] < p2.finished_at
    assert done[2][0] > 0.6
    assert_one_whole_stream(p2, prompt_tokens(fcfs_model, tokenize), "chat")


def test_responses_streams_are_never_preempted(world: World, fcfs_model: Engine) -> None:
    async def scenario() -> float:
        p2 = Stream()
        body = {"model": MODEL, "input": "A long story", "max_output_tokens": REPLY}
        task = asyncio.create_task(
            stream(world.url, world.key_a, "responses", {**body, "stream": True}, p2)
        )
        deadline = time.monotonic() + 30
        while sum(e.get("type") == "response.output_text.delta" for e in p2.events) < 10:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        took, _ = await timed_p0(world.url, world.key_b)
        await task
        return took

    # The P0 request waited for the P2 reply's remaining 35+ tokens (1.4 s at 25 tokens/s).
    assert asyncio.run(scenario()) > 1.0


def test_preemption_can_be_turned_off(world: World, fcfs_model: Engine) -> None:
    proc, url = start_gateway(1, {"TOLLGATE_ADMISSION_PREEMPT_FCFS": "false"})
    try:
        wait_until_served(url, world.key_b, MODEL, timeout=30)
        path, body, _ = CASES["chat"]

        async def scenario() -> float:
            p2 = Stream()
            task = asyncio.create_task(stream(url, world.key_a, path, {**body, "stream": True}, p2))
            await until_tokens(p2, 10)
            took, _ = await timed_p0(url, world.key_b)
            await task
            return took

        assert asyncio.run(scenario()) > 1.0  # it waited for the P2 reply, as above
    finally:
        stop(proc)


def test_a_preempted_whole_answer_is_restarted_and_billed_once(
    world: World, fcfs_model: Engine
) -> None:
    """A non-streaming P2 request has received nothing when preempted: it starts again, and
    its client gets one whole answer, billed for it alone."""
    _, body, tokenize = CASES["chat"]

    async def engine_running() -> float:
        async with httpx.AsyncClient(timeout=10) as client:
            page = (await client.get(f"{fcfs_model.url}/metrics")).text
        return sum(
            float(line.split()[-1])
            for line in page.splitlines()
            if line.startswith("vllm:num_requests_running{")
        )

    async def scenario() -> tuple[httpx.Response, float, float]:
        async def batch() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.post(
                    f"{world.v1}/chat/completions",
                    headers={"Authorization": f"Bearer {world.key_a}", "X-Tollgate-Priority": "P2"},
                    json=body,
                )
            return r, time.monotonic()

        task = asyncio.create_task(batch())
        deadline = time.monotonic() + 30
        while await engine_running() < 1:
            assert time.monotonic() < deadline, "the P2 request never reached the engine"
            await asyncio.sleep(0.02)
        p0_done = await ask_p0(world.url, world.key_b)
        answer, p2_done = await task
        return answer, p0_done, p2_done

    before = preemptions(world.url)
    answer, p0_done, p2_done = asyncio.run(scenario())
    assert p0_done < p2_done and preemptions(world.url) - before == 1
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    prompt = prompt_tokens(fcfs_model, tokenize)
    assert reply["usage"]["prompt_tokens"] == prompt
    assert reply["usage"]["completion_tokens"] == REPLY
    assert reply["choices"][0]["finish_reason"] == "length"
    billed = usage_event(answer.headers["x-request-id"])
    assert (billed.prompt_tokens, billed.completion_tokens, billed.status) == (prompt, REPLY, "ok")
