"""The simulator held to the real thing: every scenario of fidelity_scenarios.py runs against
one real vLLM (the CPU build, in Docker) and one simulator started with the same flags, and
what Tollgate and its tenants depend on must agree (see that module for what is compared and
which differences are deliberate, and why). The LoRA scenarios (lora_scenarios.py) run the
same way on a second pair, started with adapters enabled."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import httpx
import pytest

from tests import leaks
from tests.engine_sim.conftest import free_port
from tests.vllm.conftest import LABEL, MODEL_VOLUME, TEST_MODEL, VLLM_IMAGE, RealEngine
from tests.vllm.fidelity import differences, observe
from tests.vllm.fidelity_scenarios import ENGINE_FLAGS, MODEL, SCENARIOS, Scenario
from tests.vllm.lora_scenarios import (
    ADAPTER_RANKS,
    LORA_ENGINE_FLAGS,
    LORA_ENV,
    LORA_SCENARIOS,
    repo,
)

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
    with running_sim(tmp_path_factory.mktemp("fidelity"), ENGINE_FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def lora_sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The simulator with the LoRA flags, its Hugging Face cache holding the very adapter
    files the real engine reads."""
    root = tmp_path_factory.mktemp("fidelity-lora")
    copy_adapters(root / "hf" / "hub")
    env = {**LORA_ENV, "HF_HOME": str(root / "hf")}
    with running_sim(root, LORA_ENGINE_FLAGS, env) as url:
        yield url


def copy_adapters(hub: Path) -> None:
    """The test adapters' repositories, copied out of the stage's model volume."""
    box = docker.from_env().containers.create(
        VLLM_IMAGE,
        entrypoint=["true"],
        labels={LABEL: leaks.RUN},
        volumes={MODEL_VOLUME: {"bind": "/cache", "mode": "ro"}},
    )
    hub.mkdir(parents=True)
    try:
        for name in ADAPTER_RANKS:
            folder = f"/cache/hub/models--{repo(name).replace('/', '--')}"
            chunks, _ = box.get_archive(folder)
            with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as archive:
                archive.extractall(hub, filter="data")
    finally:
        box.remove(force=True)


@contextmanager
def running_sim(
    folder: Path, flags: tuple[str, ...], env: dict[str, str] | None = None
) -> Iterator[str]:
    """``python -m engine_sim`` with ``flags``, on a free loopback port; its URL."""
    port = free_port()
    log = folder / "sim.log"
    args = [TEST_MODEL, "--served-model-name", MODEL, *flags, *SIM_KNOBS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine_sim", *args, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
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


@pytest.mark.parametrize("scenario", LORA_SCENARIOS, ids=[s.name for s in LORA_SCENARIOS])
def test_simulator_serves_adapters_as_vllm_does(
    scenario: Scenario, lora_engine: RealEngine, lora_sim_engine: str
) -> None:
    """The same adapter exchange with both engines of the LoRA pair."""
    real = observe(scenario, lora_engine.url)
    sim = observe(scenario, lora_sim_engine)
    found = differences(real, sim, scenario)
    assert not found, f"{scenario.name}: the simulator differs from vLLM:\n" + "\n".join(found)
