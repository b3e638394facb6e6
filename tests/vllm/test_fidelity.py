"""The simulator held to the real thing: every scenario of fidelity_scenarios.py runs against
one real vLLM (the CPU build, in Docker) and one simulator started with the same flags, and
what Tollgate and its tenants depend on must agree (see that module for what is compared and
which differences are deliberate, and why)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine_sim.conftest import free_port
from tests.vllm.conftest import TEST_MODEL, RealEngine
from tests.vllm.fidelity import differences, observe
from tests.vllm.fidelity_scenarios import ENGINE_FLAGS, MODEL, SCENARIOS, Scenario

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# No load time and instant prefill; a decode rate slow enough that a long reply is still
# running when the abort scenarios' clients hang up.
SIM_KNOBS = (
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "0",
    "--sim-ttft-per-token-ms",
    "0",
    "--sim-decode-tps",
    "400",
)


@pytest.fixture(scope="module")
def real_engine(shared_engine: RealEngine) -> RealEngine:
    return shared_engine  # started with ENGINE_FLAGS


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python -m engine_sim`` with the real engine's flags, on a free loopback port."""
    port = free_port()
    log = tmp_path_factory.mktemp("fidelity") / "sim.log"
    args = [TEST_MODEL, "--served-model-name", MODEL, *ENGINE_FLAGS, *SIM_KNOBS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_sim", *args, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the simulator exited:\n{log.read_text()}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"the simulator did not answer /health in 30 s:\n{log.read_text()}")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_simulator_answers_as_vllm_does(
    scenario: Scenario, real_engine: RealEngine, sim_engine: str
) -> None:
    """The same request to both engines: the same shapes everywhere, the same values where
    the scenario says so."""
    real = observe(scenario, real_engine.url)
    sim = observe(scenario, sim_engine)
    found = differences(real, sim, scenario)
    assert not found, f"{scenario.name}: the simulator differs from vLLM:\n" + "\n".join(found)
