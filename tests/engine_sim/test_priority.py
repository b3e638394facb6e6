"""`--scheduling-policy priority`: the waiting queue is ordered by (priority, arrival), and a
better request preempts the worst running one, whose stream pauses and then completes."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx

from tests.engine_sim.conftest import wait_until

MSGS = [{"role": "user", "content": "Count slowly."}]
# One slot, fast prefill, 100 tok/s decode alone.
PRIORITY = [
    "m",
    "--max-num-seqs",
    "1",
    "--scheduling-policy",
    "priority",
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "0",
    "--sim-ttft-per-token-ms",
    "0.1",
    "--sim-decode-tps",
    "100",
    "--sim-bandwidth-alpha",
    "0",
]


class Stream(threading.Thread):
    """A streamed chat request in the background: when each token arrived, and the usage."""

    def __init__(self, url: str, max_tokens: int, priority: int | None, tag: str = "") -> None:
        super().__init__()
        self.body = {
            "messages": [{"role": "user", "content": f"Count slowly. {tag}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if priority is not None:
            self.body["priority"] = priority
        self.url = url
        self.times: list[float] = []
        self.usage: dict | None = None
        self.finish: str | None = None
        self.status = 0
        self.start_time = 0.0

    def run(self) -> None:
        self.start_time = time.monotonic()
        with httpx.stream(
            "POST", self.url + "/v1/chat/completions", json=self.body, timeout=30
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for c in chunk["choices"]:
                    if c["delta"].get("content"):
                        self.times.append(time.monotonic())
                    if c.get("finish_reason"):
                        self.finish = c["finish_reason"]


def open_stream(
    port: int, priority: int, max_tokens: int = 1000, started: bool = True
) -> socket.socket:
    """A raw streaming request (whose first frame has arrived, if `started`); close() the
    socket to abort it."""
    body = json.dumps(
        {
            "messages": MSGS,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "priority": priority,
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    received = b""
    deadline = time.monotonic() + 30
    while started and b"data: " not in received and time.monotonic() < deadline:
        received += s.recv(65536)
    assert not started or b"data: " in received  # the stream has started
    return s


def test_a_better_request_preempts_and_the_long_stream_pauses_then_completes(start_sim):
    """At 20 tok/s the long stream needs 3 s; the short one, arriving after its fifth token,
    preempts it and ends while the long one still has seconds to go. Without preemption the
    short one would wait for all 60 tokens; the margins are whole seconds of the engine's
    pace, not guesses about how fast this machine is."""
    sim = start_sim(*PRIORITY[:-4], "--sim-decode-tps", "20", "--sim-bandwidth-alpha", "0")
    long = Stream(sim.url, 60, 5)
    long.start()
    wait_until(lambda: len(long.times) >= 5, timeout=30, what="the long stream to be decoding")
    short = Stream(sim.url, 5, 0)
    short.start()
    short.join()
    assert (
        short.status == 200 and short.finish == "length" and short.usage["completion_tokens"] == 5
    )
    long.join()
    assert short.times[-1] < long.times[-1] - 1.0
    assert long.status == 200 and long.finish == "length"
    assert len(long.times) == 60, "every token exactly once: a pause, not a restart"
    assert long.usage == {
        "prompt_tokens": long.usage["prompt_tokens"],
        "completion_tokens": 60,
        "total_tokens": long.usage["prompt_tokens"] + 60,
    }
    assert sim.metric("vllm:num_preemptions_total") == 1
    assert sim.metric("vllm:request_success_total", 'finished_reason="length"') == 2
    assert sim.metric("vllm:generation_tokens_total") == 65
    assert (
        sim.metric("vllm:num_requests_running") == 0
        and sim.metric("vllm:num_requests_waiting") == 0
    )
    assert sim.metric("vllm:kv_cache_usage_perc") == 0


def test_the_preempted_request_is_counted_as_waiting(start_sim):
    """--sim-hold: the long request holds the slot, the better one takes it from it, and
    nothing generates until SIGUSR1, so the counts stay put while the test reads them."""
    sim = start_sim(*PRIORITY, "--sim-hold")
    long = Stream(sim.url, 60, 5)
    long.start()
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 1, what="the long one to run")
    short = Stream(sim.url, 30, 0)
    short.start()
    wait_until(lambda: sim.metric("vllm:num_preemptions_total") == 1, what="the preemption")
    assert sim.metric("vllm:num_requests_running") == 1
    assert sim.metric("vllm:num_requests_waiting") == 1
    os.kill(sim.proc.pid, signal.SIGUSR1)
    long.join()
    short.join()
    assert len(long.times) == 60 and len(short.times) == 30
    assert sim.metric("vllm:num_preemptions_total") == 1


def test_equal_or_worse_priority_does_not_preempt(start_sim):
    """--sim-hold: while the first request holds the slot (generating nothing until SIGUSR1),
    requests of equal and worse priority wait behind it instead of taking it."""
    sim = start_sim(*PRIORITY, "--sim-hold")
    first = Stream(sim.url, 20, 0, "a")
    first.start()
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 1, what="the first to run")
    same, worse = Stream(sim.url, 2, 0, "b"), Stream(sim.url, 2, 3, "c")
    same.start()
    worse.start()
    wait_until(lambda: sim.metric("vllm:num_requests_waiting") == 2, what="both to queue")
    assert sim.metric("vllm:num_requests_running") == 1
    assert sim.metric("vllm:num_preemptions_total") == 0
    os.kill(sim.proc.pid, signal.SIGUSR1)
    for t in (first, same, worse):
        t.join()
    assert (len(first.times), len(same.times), len(worse.times)) == (20, 2, 2)
    assert sim.metric("vllm:num_preemptions_total") == 0


def test_waiting_requests_run_by_priority_then_arrival(start_sim):
    # A request that nothing preempts (nothing below -10 arrives) holds the one slot until
    # every request is queued (--sim-hold: nothing generates meanwhile, however long that
    # takes); then its client goes away, SIGUSR1 lets the engine go on and the queue drains.
    sim = start_sim(*PRIORITY, "--sim-hold")
    blocker = open_stream(sim.port, priority=-10, started=False)
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 1, what="the blocker to run")
    order = [("p3", 3), ("p1-first", 1), ("p2", 2), ("p1-second", 1), ("p0", 0)]
    streams = {}
    for n, (tag, prio) in enumerate(order):
        streams[tag] = Stream(sim.url, 5, prio, tag)
        streams[tag].start()
        wait_until(
            lambda n=n: sim.metric("vllm:num_requests_waiting") == n + 1, what=f"{tag} to queue"
        )
    blocker.close()
    wait_until(lambda: sim.metric("vllm:num_requests_waiting") == 4, what="the blocker to leave")
    os.kill(sim.proc.pid, signal.SIGUSR1)
    for t in streams.values():
        t.join()
    served = sorted(streams, key=lambda tag: streams[tag].times[0])
    assert served == ["p0", "p1-first", "p1-second", "p2", "p3"]
    assert sim.metric("vllm:num_preemptions_total") == 0


def test_priority_must_be_an_integer(start_sim):
    sim = start_sim(*PRIORITY)
    for bad in ("high", 1.5, True, [0]):
        r = httpx.post(sim.url + "/v1/chat/completions", json={"messages": MSGS, "priority": bad})
        assert r.status_code == 400, bad
        err = r.json()["error"]
        assert err["param"] == "priority" and err["code"] == 400 and err["type"] == "Bad Request"
    r = httpx.post(
        sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": -3}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_fcfs_refuses_a_non_zero_priority(start_sim):
    sim = start_sim("m", "--sim-load-seconds", "0", "--sim-ttft-ms", "0", "--sim-decode-tps", "0")
    for path, body in (
        ("/v1/chat/completions", {"messages": MSGS}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(sim.url + path, json={**body, "max_tokens": 2, "priority": 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert "Priority scheduling is not enabled." in err["message"] and err["code"] == 400
        assert (
            httpx.post(sim.url + path, json={**body, "max_tokens": 2, "priority": 0}).status_code
            == 200
        )


def test_a_preempted_request_that_disconnects_is_aborted(start_sim):
    sim = start_sim(*PRIORITY, "--sim-hold")  # nothing generates until SIGUSR1
    s = open_stream(sim.port, priority=5, started=False)
    wait_until(lambda: sim.metric("vllm:num_requests_running") == 1, what="it to run")
    short = Stream(sim.url, 40, 0)
    short.start()
    wait_until(lambda: sim.metric("vllm:num_preemptions_total") == 1, what="the preemption")
    assert sim.metric("vllm:num_requests_waiting") == 1
    s.close()
    wait_until(
        lambda: sim.metric("vllm:num_requests_waiting") == 0, what="the preempted one to leave"
    )
    os.kill(sim.proc.pid, signal.SIGUSR1)
    short.join()
    assert len(short.times) == 40
    # vLLM counts no aborted request in vllm:request_success_total, whatever its label says.
    assert sim.metric("vllm:request_success_total", 'finished_reason="abort"') == 0
    assert (
        sim.metric("vllm:num_requests_running") == 0 and sim.metric("vllm:kv_cache_usage_perc") == 0
    )
