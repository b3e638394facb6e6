"""`--scheduling-policy priority`, as vLLM 0.32's V1 scheduler does it: the waiting queue is
ordered by (priority, arrival), a better request never takes a running one's slot (it takes
the next slot that frees), and when the KV cache runs out during decode the worst running
request is preempted: its stream pauses and then completes."""

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


def test_a_better_request_waits_for_the_slot_instead_of_taking_it(start_sim):
    """At 20 tok/s the long stream needs 3 s; the better one, arriving after its fifth token,
    gets its first token only once the long one has ended (vLLM 0.32 on the CPU engine did
    the same: tests/vllm/test_priority.py). The margins are whole seconds of the engine's
    pace, not guesses about how fast this machine is."""
    sim = start_sim(*PRIORITY[:-4], "--sim-decode-tps", "20", "--sim-bandwidth-alpha", "0")
    long = Stream(sim.url, 60, 5)
    long.start()
    wait_until(lambda: len(long.times) >= 5, timeout=30, what="the long stream to be decoding")
    short = Stream(sim.url, 5, 0)
    short.start()
    wait_until(lambda: sim.metric("vllm:num_requests_waiting") == 1, what="the better one to queue")
    short.join()
    long.join()
    assert short.status == long.status == 200
    assert short.times[0] >= long.times[-1]
    assert len(long.times) == 60 and len(short.times) == 5
    assert sim.metric("vllm:num_preemptions_total") == 0
    assert sim.metric("vllm:request_success_total", 'finished_reason="length"') == 2


def kv_tight(policy: str) -> list[str]:
    """Two slots and a KV cache of 6 blocks of 16 tokens at 20 tok/s: two 60-token replies
    to a short prompt (5 blocks each at the end) cannot both grow to their end."""
    args = [*PRIORITY[:-4], "--sim-decode-tps", "20", "--sim-bandwidth-alpha", "0"]
    args[args.index("--max-num-seqs") + 1] = "2"
    args[args.index("--scheduling-policy") + 1] = policy
    return [*args, "--sim-kv-cache-tokens", "96"]


def test_a_full_kv_cache_preempts_the_worst_priority_whose_stream_pauses_then_completes(
    start_sim,
):
    """The better request arrives second; when the KV cache runs out it is the worse one
    (running first) that is preempted, and the better one finishes first."""
    sim = start_sim(*kv_tight("priority"))
    worse = Stream(sim.url, 60, 5, "w")
    worse.start()
    wait_until(lambda: len(worse.times) >= 2, timeout=30, what="the worse one to be decoding")
    better = Stream(sim.url, 60, 0, "b")
    better.start()
    better.join()
    worse.join()
    assert better.status == worse.status == 200
    assert better.times[-1] < worse.times[-1] - 0.5
    assert len(worse.times) == len(better.times) == 60, "a pause, not a restart"
    assert worse.usage == {
        "prompt_tokens": worse.usage["prompt_tokens"],
        "completion_tokens": 60,
        "total_tokens": worse.usage["prompt_tokens"] + 60,
    }
    assert sim.metric("vllm:num_preemptions_total") >= 1
    assert sim.metric("vllm:request_success_total", 'finished_reason="length"') == 2
    assert sim.metric("vllm:generation_tokens_total") == 120
    assert (
        sim.metric("vllm:num_requests_running") == 0
        and sim.metric("vllm:num_requests_waiting") == 0
    )
    assert sim.metric("vllm:kv_cache_usage_perc") == 0


def test_under_fcfs_a_full_kv_cache_preempts_the_last_scheduled(start_sim):
    """vLLM's fcfs preempts the request it scheduled last: the second one waits for the first."""
    sim = start_sim(*kv_tight("fcfs"))
    first = Stream(sim.url, 60, None, "f")
    first.start()
    wait_until(lambda: len(first.times) >= 2, timeout=30, what="the first to be decoding")
    second = Stream(sim.url, 60, None, "s")
    second.start()
    wait_until(
        lambda: sim.metric("vllm:num_preemptions_total") >= 1, timeout=30, what="a preemption"
    )
    assert sim.metric("vllm:num_requests_waiting") == 1
    first.join()
    second.join()
    assert first.times[-1] < second.times[-1] - 0.5
    assert len(first.times) == len(second.times) == 60


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
    sim = start_sim(*kv_tight("priority"))
    s = open_stream(sim.port, priority=5, max_tokens=60)
    better = Stream(sim.url, 60, 0)
    better.start()
    wait_until(lambda: sim.metric("vllm:num_preemptions_total") >= 1, what="the preemption")
    assert sim.metric("vllm:num_requests_waiting") == 1
    s.close()
    wait_until(
        lambda: sim.metric("vllm:num_requests_waiting") == 0, what="the preempted one to leave"
    )
    better.join()
    assert len(better.times) == 60
    # vLLM counts no aborted request in vllm:request_success_total, whatever its label says.
    assert sim.metric("vllm:request_success_total", 'finished_reason="abort"') == 0
    assert sim.metric("vllm:request_success_total", 'finished_reason="length"') == 1
    assert (
        sim.metric("vllm:num_requests_running") == 0 and sim.metric("vllm:kv_cache_usage_perc") == 0
    )
