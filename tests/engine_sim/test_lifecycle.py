"""Start-up, command line and failure modes, the way an appliance supervising vLLM sees them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import orjson
import pytest

from tests.engine_sim.conftest import FAST, ROOT, wait_until


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine_sim", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_not_listening_while_loading_and_progress_is_printed(start_sim):
    """--sim-hold-load keeps it loading (before its last shard) until SIGUSR1."""
    sim = start_sim(
        "Qwen/Qwen3-8B",
        "--sim-load-seconds",
        "1.2",
        "--sim-shards",
        "3",
        "--sim-hold-load",
        wait=False,
    )
    wait_until(
        lambda: "checkpoint shards:  67% Completed | 2/3" in sim.output(),
        timeout=30,
        what="the progress line before the held shard",
    )
    assert "checkpoint shards:   0% Completed | 0/3" in sim.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url + "/health")
    os.kill(sim.proc.pid, signal.SIGUSR1)
    wait_until(sim.listening, timeout=30, what="listening after load")
    out = sim.output()
    assert "Loading safetensors checkpoint shards:  33% Completed | 1/3 [" in out
    assert "Loading safetensors checkpoint shards: 100% Completed | 3/3 [" in out
    assert "vLLM API server version 0.33.0" in out and "Application startup complete." in out
    assert httpx.get(sim.url + "/health").status_code == 200


def test_knobs_come_from_the_environment_too(start_sim):
    sim = start_sim(
        "m",
        "--sim-ttft-ms",
        "0",
        env={"SIM_LOAD_SECONDS": "0", "SIM_SHARDS": "7", "SIM_DECODE_TPS": "0"},
    )
    assert "| 7/7 [" in sim.output()


def test_vllm_flags_are_accepted(start_sim):
    sim = start_sim(
        "org/model",
        "--served-model-name",
        "a",
        "--served-model-name",
        "b",
        "--max-model-len",
        "32k",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--gpu-memory-utilization",
        "0.8",
        "--trust-remote-code",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-batched-tokens",
        "8K",
        "--disable-log-requests",
        "--load-format",
        "dummy",
        *FAST,
    )
    cards = httpx.get(sim.url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [
        ("a", "org/model", 32000),
        ("b", "org/model", 32000),
    ]


def test_bad_command_lines_exit_like_vllm():
    unknown = run_cli("m", "--no-such-flag", "1")
    assert unknown.returncode == 2 and "unrecognized arguments" in unknown.stderr
    tools = run_cli("m", "--enable-auto-tool-choice")
    assert tools.returncode != 0 and "--tool-call-parser" in tools.stderr


def test_load_failure_exits_non_zero():
    r = run_cli("m", "--sim-load-seconds", "0", "--sim-load-fail-exit-code", "3")
    assert r.returncode == 3 and "CUDA out of memory" in r.stdout


def test_after_a_crash_health_is_503_and_requests_fail(start_sim):
    """During the grace period (long here, so a slow machine sees it) the dead engine still
    answers: /health 503, new requests 500."""
    sim = start_sim(
        "m", "--sim-crash-after-requests", "2", "--sim-crash-grace-seconds", "300", *FAST
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(sim.url + "/v1/chat/completions", json=body).status_code == 200
    assert httpx.get(sim.url + "/health").status_code == 503
    r = httpx.post(sim.url + "/v1/chat/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert "EngineCore encountered a fatal error" in sim.output()
    assert sim.proc.poll() is None


@pytest.mark.parametrize("code", [0, 1])
def test_crash_after_n_requests_exits_with_the_configured_code(start_sim, code):
    sim = start_sim(
        "m",
        "--sim-crash-after-requests",
        "2",
        "--sim-crash-exit-code",
        str(code),
        "--sim-crash-grace-seconds",
        "0.5",
        *FAST,
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(sim.url + "/v1/chat/completions", json=body).status_code == 200
    assert sim.proc.wait(timeout=30) == code
    assert "EngineCore encountered a fatal error" in sim.output()


def test_crash_mid_stream_sends_an_error_frame(start_sim):
    """The engine dies (SIGUSR2, as --sim-crash-after-* would) once the stream has started."""
    sim = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "20",
        "--sim-crash-grace-seconds",
        "1",
    )
    frames = []
    with httpx.stream(
        "POST",
        sim.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line:
                frames.append(line)
                if len(frames) == 2:
                    os.kill(sim.proc.pid, signal.SIGUSR2)
    assert 2 <= len(frames) < 100
    assert frames[-1] == "data: [DONE]"
    assert '"type":"InternalServerError"' in frames[-2]
    assert sim.proc.wait(timeout=30) == 1


def test_hang_keeps_the_socket_but_answers_nothing(start_sim):
    sim = start_sim("m", "--sim-hang-after-requests", "1", *FAST)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(sim.url + "/v1/chat/completions", json=body).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(sim.url + "/health", timeout=0.5)
    with socket.create_connection(("127.0.0.1", sim.port), timeout=1):
        pass  # still accepting connections
    assert sim.proc.poll() is None


def test_sigterm_while_loading_exits_zero(start_sim):
    sim = start_sim("m", "--sim-shards", "2", "--sim-hold-load", wait=False)
    wait_until(lambda: "1/2" in sim.output(), timeout=30, what="loading to be under way (held)")
    os.kill(sim.proc.pid, signal.SIGTERM)
    assert sim.proc.wait(timeout=30) == 0
    assert "Uvicorn running" not in sim.output()


def test_sigterm_exits_zero(start_sim):
    sim = start_sim("m", *FAST)
    os.kill(sim.proc.pid, signal.SIGTERM)
    assert sim.proc.wait(timeout=30) == 0


def _running(sim) -> float:
    metrics = httpx.get(sim.url + "/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:num_requests_running"))
    return float(line.split()[-1])


def test_streams_pause_after_the_given_tokens_until_sigusr1(start_sim):
    """--sim-pause-after-tokens: a stream stops after exactly those tokens and goes on only
    when released; a client leaving while it is paused ends the request; non-streamed
    requests never pause."""
    sim = start_sim("m", *FAST, "--sim-pause-after-tokens", "0,1,3")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    whole = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert whole["usage"]["completion_tokens"] == 6
    stream = {**body, "stream": True}
    contents = []

    def release_first_token() -> None:  # paused before its first byte: released once running
        wait_until(lambda: _running(sim) == 1, timeout=30, what="the stream to run")
        os.kill(sim.proc.pid, signal.SIGUSR1)

    releaser = threading.Thread(target=release_first_token)
    releaser.start()
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=stream, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = orjson.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    contents.append(delta["content"])
                    if len(contents) in (1, 3):
                        # Nothing more comes while paused: the engine runs it, sends nothing.
                        assert _running(sim) == 1
                        os.kill(sim.proc.pid, signal.SIGUSR1)
    releaser.join()
    assert len(contents) == 6
    wait_until(lambda: _running(sim) == 0, timeout=30, what="the stream to end")
    releaser = threading.Thread(target=release_first_token)
    releaser.start()
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=stream, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                break  # paused after this token: hang up
        else:
            raise AssertionError("the stream ended without a token")
    releaser.join()
    wait_until(lambda: _running(sim) == 0, timeout=30, what="the paused request to end")
