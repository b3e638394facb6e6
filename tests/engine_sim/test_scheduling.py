"""Continuous batching as a client and the appliance see it: a bounded running set, a
waiting queue beyond it, slower decode as the batch grows, abort on disconnect."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx

from tests.engine_sim.conftest import wait_until

MSGS = [{"role": "user", "content": "Count slowly."}]


def stream_in_background(url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    def go() -> None:
        httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"messages": MSGS, "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
        )

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_requests_beyond_max_num_seqs_wait(start_sim):
    """--sim-hold keeps the two running sequences from generating until SIGUSR1, so the
    full batch stays put however slowly this machine runs the test."""
    sim = start_sim(
        "m",
        "--max-num-seqs",
        "2",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "40",
        "--sim-bandwidth-alpha",
        "0",
        "--sim-hold",
    )
    threads = stream_in_background(sim.url, 5, 12)
    wait_until(lambda: sim.metric("vllm:num_requests_waiting") == 3, what="3 waiting")
    assert sim.metric("vllm:num_requests_running") == 2
    assert 0 < sim.metric("vllm:kv_cache_usage_perc") <= 1
    assert httpx.get(sim.url + "/load").json() == {"server_load": 5}
    assert sim.metric("vllm:generation_tokens_total") == 0
    os.kill(sim.proc.pid, signal.SIGUSR1)
    for t in threads:
        t.join()
    assert (
        sim.metric("vllm:num_requests_waiting") == 0
        and sim.metric("vllm:num_requests_running") == 0
    )
    assert sim.metric("vllm:request_success_total", 'finished_reason="length"') == 5
    assert sim.metric("vllm:kv_cache_usage_perc") == 0


def test_queue_full_is_503(start_sim):
    sim = start_sim(
        "m",
        "--max-num-seqs",
        "1",
        "--max-num-queued-reqs",
        "1",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "20",
        "--sim-hold",
    )
    threads = stream_in_background(sim.url, 2, 20)
    wait_until(lambda: sim.metric("vllm:num_requests_waiting") == 1, what="one waiting")
    r = httpx.post(sim.url + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 503 and r.json()["error"]["type"] == "Service Unavailable"
    os.kill(sim.proc.pid, signal.SIGUSR1)
    for t in threads:
        t.join()


def timed_request(url: str, since: list[float] | None = None) -> float:
    start = time.monotonic()
    httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"messages": MSGS, "max_tokens": 10, "ignore_eos": True},
    )
    return time.monotonic() - (since[0] if since else start)


def test_decode_slows_down_as_the_batch_grows(start_sim):
    """10 tokens are 9 decode steps: at 20 tok/s alone that is 0.45 s. With alpha=1 and four
    sequences in the batch every step costs 4x, so each of them takes at least 1.8 s.

    --sim-hold admits all four before any generates, so they share the batch from their first
    step however late a loaded machine starts the threads; the batched times run from the
    release and are lower bounds the engine's pacing guarantees. The request alone must end
    before the batched minimum (1.35 s of slack for a slow machine)."""
    sim = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "20",
        "--sim-bandwidth-alpha",
        "1",
        "--sim-hold",
    )
    released: list[float] = []
    times: list[float] = []
    threads = [
        threading.Thread(target=lambda: times.append(timed_request(sim.url, released)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 4, what="4 running")
    released.append(time.monotonic())
    os.kill(sim.proc.pid, signal.SIGUSR1)
    for t in threads:
        t.join()
    alone = timed_request(sim.url)
    assert len(times) == 4
    assert min(times) >= 9 * 4 / 20
    assert 9 / 20 <= alone < min(times)


def test_client_disconnect_aborts_the_request(start_sim):
    sim = start_sim("m", "--sim-load-seconds", "0", "--sim-ttft-ms", "0", "--sim-decode-tps", "10")
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":100,"stream":true}'
    s = socket.create_connection(("127.0.0.1", sim.port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    received = b""
    deadline = time.monotonic() + 30
    while b"data: " not in received and time.monotonic() < deadline:
        received += s.recv(65536)
    assert b"data: " in received  # the stream has started
    assert sim.metric("vllm:num_requests_running") == 1
    s.close()
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 0, what="the slot to be freed")
    # As in vLLM, an aborted request is not a "success" of any finished_reason.
    assert sim.metric("vllm:request_success_total", 'finished_reason="abort"') == 0
    assert sim.metric("vllm:generation_tokens_total") < 100


def _post_raw(port: int, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    return s


def test_finish_abandoned_runs_a_disconnected_stream_to_its_end(start_sim):
    """--sim-finish-abandoned (not vLLM): the client hangs up after 5 tokens, while the
    stream is paused there (--sim-pause-after-tokens); released, the sequence goes on
    generating to max_tokens on its slot and finishes as `length`."""
    sim = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "50",
        "--sim-pause-after-tokens",
        "5",
        "--sim-finish-abandoned",
    )
    body = (
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":100,"ignore_eos":true,'
        b'"stream":true}'
    )
    s = _post_raw(sim.port, body)
    received = b""
    deadline = time.monotonic() + 30
    # The role chunk (its content empty) and five tokens.
    while received.count(b'"content":"') < 6 and time.monotonic() < deadline:
        received += s.recv(65536)
    assert sim.metric("vllm:generation_tokens_total") == 5  # paused after its fifth token
    s.close()
    os.kill(sim.proc.pid, signal.SIGUSR1)
    # Still on its slot, generating for nobody.
    wait_until(
        lambda: (
            sim.metric("vllm:num_requests_running") == 1
            and sim.metric("vllm:generation_tokens_total") > 5
        ),
        what="the abandoned sequence to go on generating",
    )
    wait_until(
        lambda: sim.metric("vllm:request_success_total", 'finished_reason="length"') == 1,
        what="the abandoned sequence to finish",
    )
    assert sim.metric("vllm:generation_tokens_total") == 100
    assert sim.metric("vllm:num_requests_running") == 0
    assert sim.metric("vllm:request_success_total", 'finished_reason="abort"') == 0


def test_finish_abandoned_also_finishes_a_whole_answer(start_sim):
    """Non-streaming: the client hangs up while its request runs (--sim-hold keeps it from
    generating until SIGUSR1); it still generates all its tokens. The same engine without
    the knob aborts it (vLLM's behaviour, as test_client_disconnect_aborts_the_request)."""
    sim = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-decode-tps",
        "50",
        "--sim-hold",
        env={"SIM_FINISH_ABANDONED": "1"},
    )
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":60,"ignore_eos":true}'
    s = _post_raw(sim.port, body)
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 1, what="the request to run")
    s.close()
    os.kill(sim.proc.pid, signal.SIGUSR1)
    wait_until(
        lambda: sim.metric("vllm:request_success_total", 'finished_reason="length"') == 1,
        what="the abandoned request to finish",
    )
    assert sim.metric("vllm:generation_tokens_total") == 60
    assert sim.metric("vllm:num_requests_running") == 0


def test_time_to_first_token_grows_with_the_prompt(start_sim):
    sim = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-ttft-per-token-ms",
        "1",
        "--sim-decode-tps",
        "0",
        "--no-enable-prefix-caching",
    )
    start = time.monotonic()
    httpx.post(
        sim.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 1},
    )
    assert time.monotonic() - start >= 0.3
    assert sim.metric("vllm:time_to_first_token_seconds_sum") >= 0.3
