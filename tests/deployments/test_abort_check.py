"""An idle engine asked whether it drops a request its client left (deployments/
abort_check.py), and the controller acting on the answer before any preemption happened.

The engines are the simulator, which aborts such requests as vLLM does, or with
``--sim-finish-abandoned`` goes on with them as some engines and proxies do (the real vLLM
answers the same question in tests/vllm/test_engine_image.py).
"""

import threading
from collections.abc import Iterator

import httpx
import pytest

from core.keyspace import abort_check_key, pool_keys, preempt_verdict_key
from core.redis import get_redis
from deployments import services as deployment_services
from deployments.abort_check import engine_drops_abandoned
from gateway.controller import EngineCount
from gateway.tuning import check_idle_engine
from tests.engine_sim.conftest import wait_until
from tests.gateway.conftest import Engine, deploy, make_model, start_engine, stop

SLOW = ("--sim-decode-tps", "25", "--sim-ttft-ms", "20")


@pytest.fixture
def dropping() -> Iterator[Engine]:
    engine, proc = start_engine(("sim-drops",), *SLOW)
    yield engine
    stop(proc)


@pytest.fixture
def finishing() -> Iterator[Engine]:
    engine, proc = start_engine(("sim-keeps",), *SLOW, "--sim-finish-abandoned")
    yield engine
    stop(proc)


def running(engine: Engine) -> float:
    text = httpx.get(f"{engine.url}/metrics", timeout=5).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running{")
    )


def test_an_engine_that_aborts_says_so(dropping: Engine) -> None:
    assert engine_drops_abandoned(dropping.url, "sim-drops") is True
    assert running(dropping) == 0


def test_an_engine_that_finishes_what_its_client_left_says_so(finishing: Engine) -> None:
    assert engine_drops_abandoned(finishing.url, "sim-keeps") is False
    assert running(finishing) == 1  # the check's request runs on (256 tokens at 25/s)


def test_a_busy_engine_is_not_asked(dropping: Engine) -> None:
    """Someone else's request on the engine: the count could not tell, so no answer and
    no check request sent."""
    body = {"model": "sim-drops", "prompt": "busy", "max_tokens": 100, "ignore_eos": True}
    busy = threading.Thread(
        target=lambda: httpx.post(f"{dropping.url}/v1/completions", json=body, timeout=30)
    )
    busy.start()
    try:
        wait_until(lambda: running(dropping) == 1, 10, "the busy request to start")
        assert engine_drops_abandoned(dropping.url, "sim-drops") is None
    finally:
        busy.join()


def test_an_unknown_model_gets_no_answer(dropping: Engine) -> None:
    assert engine_drops_abandoned(dropping.url, "no-such-model") is None


@pytest.mark.django_db
def test_the_controller_asks_an_idle_engine_before_any_preemption(finishing: Engine) -> None:
    """No verdict yet and the engines idle: the controller's tick asks, stores "frees none"
    (so admission never preempts there, not even on probation); asked again no sooner than
    a minute."""
    node = deployment_services.register_node(
        None, name="abort-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    deployment = deploy(make_model("sim-keeps"), node, finishing.port)
    model_id, replica_id = deployment.model_id, deployment.replica_set.get().pk
    client = get_redis()
    client.delete(preempt_verdict_key(model_id), abort_check_key(model_id))
    idle = EngineCount(scraped_at=1.0, engine=0, holders=0)
    check_idle_engine(model_id, [replica_id], idle)
    assert client.get(preempt_verdict_key(model_id)) == b"0"
    assert client.hget(pool_keys(model_id)[8], "frees") is None
    client.delete(preempt_verdict_key(model_id))
    check_idle_engine(model_id, [replica_id], idle)  # within the minute: not asked again
    assert client.get(preempt_verdict_key(model_id)) is None
