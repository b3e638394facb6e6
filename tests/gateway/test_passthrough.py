"""What engines send passes through untouched: reasoning, tool calls, errors mid-stream."""

import os
import signal
import subprocess

import httpx
import orjson
import pytest

from tests.gateway.conftest import World, add_routed_model, start_engine, stop
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def frames(
    response: httpx.Response, kill_after: tuple[int, subprocess.Popen] | None = None
) -> list[dict | str]:
    """The stream's data frames; with `kill_after=(n, engine)`, the engine is told to die
    (SIGUSR2) right after the n-th frame with content."""
    out = []
    content = 0
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            frame = data if data == "[DONE]" else orjson.loads(data)
            out.append(frame)
            if isinstance(frame, dict) and any(
                c.get("delta", {}).get("content") for c in frame.get("choices", [])
            ):
                content += 1
                if kill_after and content == kill_after[0]:
                    os.kill(kill_after[1].pid, signal.SIGUSR2)
    return out


def comparable(frame: dict | str) -> dict | str:
    """A frame without the parts that differ per request (ids, timestamps), nor
    system_fingerprint: vLLM sends it on the usage chunk when there is one (the gateway
    always asks for usage and strips that chunk), else on the finishing chunk."""
    if not isinstance(frame, dict):
        return frame
    frame = {k: v for k, v in frame.items() if k not in ("id", "created", "system_fingerprint")}
    for choice in frame.get("choices", []):
        for call in choice.get("delta", {}).get("tool_calls", []) or []:
            call.pop("id", None)
    return frame


def test_reasoning_and_tool_call_frames_pass_through_unchanged(world: World) -> None:
    engine, proc = start_engine(
        ("sim-think",),
        "--reasoning-parser",
        "deepseek_r1",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    try:
        add_routed_model(world, "sim-think", engine.port)
        for body in (
            {
                "model": "sim-think",
                "messages": [{"role": "user", "content": "Think first."}],
                "stream": True,
                "max_tokens": 40,
            },
            {
                "model": "sim-think",
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "stream": True,
                "tools": TOOLS,
                "tool_choice": "auto",
            },
        ):
            with httpx.stream("POST", f"{engine.url}/v1/chat/completions", json=body) as r:
                direct = frames(r)
            with httpx.stream(
                "POST",
                f"{world.v1}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {world.key_a}"},
            ) as r:
                through = frames(r)
            assert [comparable(f) for f in through] == [comparable(f) for f in direct]
        deltas = [f["choices"][0]["delta"] for f in through if isinstance(f, dict) and f["choices"]]
        assert any("tool_calls" in d for d in deltas)
        first = [f for f in direct if isinstance(f, dict) and f["choices"]]
        assert first  # sanity: the engine produced frames at all
    finally:
        stop(proc)


def test_engine_death_mid_stream_reaches_the_client_as_an_openai_error_frame(world: World) -> None:
    """The engine dies (SIGUSR2) once the client has read five tokens of a 200-token stream."""
    engine, proc = start_engine(
        ("sim-dying",),
        "--sim-decode-tps",
        "20",
        "--sim-output-tokens-min",
        "200",
        "--sim-output-tokens-max",
        "200",
    )
    try:
        add_routed_model(world, "sim-dying", engine.port)
        with httpx.stream(
            "POST",
            f"{world.v1}/chat/completions",
            timeout=30,
            json={
                "model": "sim-dying",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            },
            headers={"Authorization": f"Bearer {world.key_a}"},
        ) as r:
            request_id = r.headers["x-request-id"]
            got = frames(r, kill_after=(5, proc))
    finally:
        stop(proc)
    assert got[-1] == "[DONE]"
    error = got[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    delivered = sum(
        1
        for f in got
        if isinstance(f, dict) and f.get("choices") and f["choices"][0]["delta"].get("content")
    )
    assert 5 <= delivered < 200  # it died in the middle
    event = usage_event(request_id)
    assert event.status == "error"
    assert 0 < event.completion_tokens and abs(event.completion_tokens - delivered) <= 1
