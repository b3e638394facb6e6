"""Fixtures that run the simulator engine as a real process on a loopback port.

`start_sim(*args)` launches `python -m engine_sim <args>` on a free port, waits until it
answers /health (unless wait=False), and stops it by its PID at teardown. Its combined
output goes to a file the test can read (`sim.output()`), which is how the start-up
progress lines are checked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every time knob at zero: the contract tests check shapes, not timing.
FAST = [
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "0",
    "--sim-ttft-per-token-ms",
    "0",
    "--sim-decode-tps",
    "0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> object:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Sim:
    """A running simulator process."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def metric(self, name: str, labels: str = "") -> float:
        """Value of one sample on /metrics, e.g. metric('vllm:num_requests_running')."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name}{{{labels}}} not on /metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., Sim]]:
    sims: list[Sim] = []

    def start(*args: str, wait: bool = True, env: dict[str, str] | None = None) -> Sim:
        port = free_port()
        log = tmp_path / f"sim-{port}.log"
        cmd = [
            sys.executable,
            "-m",
            "engine_sim",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        sim = Sim(proc, port, log)
        sims.append(sim)
        if wait:
            wait_until(
                lambda: sim.proc.poll() is not None or sim.listening(), what="simulator to listen"
            )
            assert sim.proc.poll() is None, f"simulator exited early:\n{sim.output()}"
        return sim

    yield start
    for sim in sims:
        sim.stop()


@pytest.fixture(scope="module")
def module_sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Sim]]:
    """Like start_sim but shared by a module: for read-mostly contract tests."""
    sims: dict[tuple, Sim] = {}
    tmp = tmp_path_factory.mktemp("sims")

    def get(*args: str, env: dict[str, str] | None = None) -> Sim:
        key = (args, tuple(sorted((env or {}).items())))
        if key not in sims:
            port = free_port()
            log = tmp / f"sim-{port}.log"
            cmd = [
                sys.executable,
                "-m",
                "engine_sim",
                *args,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                )
            sim = Sim(proc, port, log)
            wait_until(
                lambda: sim.proc.poll() is not None or sim.listening(), what="simulator to listen"
            )
            assert sim.proc.poll() is None, f"simulator exited early:\n{sim.output()}"
            sims[key] = sim
        return sims[key]

    yield get
    for sim in sims.values():
        sim.stop()


def sse_events(resp: httpx.Response) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of an SSE body whose frames carry `event:` lines."""
    out = []
    for frame in resp.text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def tokenize(sim: Sim, **body: object) -> int:
    """The engine's own count for a prompt or messages body (POST /tokenize)."""
    r = httpx.post(sim.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]
