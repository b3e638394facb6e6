"""A real Celery worker consuming a node queue; weight staging; external engines."""

import os
import signal
import socket
import subprocess
import sys
from decimal import Decimal

import pytest

from deployments import fleet, services, staging, tasks
from deployments.choices import OperationStatus, ReplicaState
from deployments.models import CatalogModel, Deployment, Node, Operation, Replica, StagedModel
from gateway.state import load_snapshot
from tests.databases import database_url
from tests.deployments.conftest import SIM_IMAGE, sim_env
from tests.deployments.test_docker import containers, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.docker
def test_a_celery_worker_on_the_node_queue_deploys(
    docker_node: Node, sim_model: CatalogModel, stack: str, redis_namespace: str
) -> None:
    """The deploy task goes through Redis to a `celery worker` consuming only this node's queue."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "TOLLGATE_REDIS_PREFIX": redis_namespace,
        "TOLLGATE_STACK_ID": stack,
        "TOLLGATE_MODEL_CACHE_VOLUME": f"{stack}-models",
        "TOLLGATE_COMPILE_CACHE_VOLUME": f"{stack}-compile",
        "TOLLGATE_PULL_POLICY": "never",
        "TOLLGATE_ENGINE_POLL_SECONDS": "0.1",
        "TOLLGATE_ENV": "test",
    }
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-Q",
            docker_node.queue,
            "--pool",
            "solo",
            "--concurrency",
            "1",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "WARNING",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        services.create_deployment(
            None,
            name="tiny",
            model=sim_model,
            node=docker_node,
            image=SIM_IMAGE,
            env=sim_env(),
            engine_args={"max-num-seqs": 4},
        )
        op = Operation.objects.get(deployment__name="tiny")
        wait_for(lambda: Operation.objects.get(pk=op.pk).status == OperationStatus.SUCCEEDED, 60)
        assert Replica.objects.get(deployment__name="tiny").state == ReplicaState.READY
        assert len(containers(stack)) == 1
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


# A stand-in for `hf download` inside the engine image: it prints the Hugging Face CLI's
# progress bar and writes files where the hub cache keeps the repo.
FAKE_HF = r"""
import os, sys, time
repo = sys.argv[1]
path = "/root/.cache/huggingface/hub/models--" + repo.replace("/", "--") + "/snapshots/main"
os.makedirs(path, exist_ok=True)
for i in range(1, 5):
    with open(f"{path}/model-{i:05d}-of-00004.safetensors", "wb") as f:
        f.write(b"\0" * 250_000)
    print(f"Fetching 4 files:  {25*i}%|##| {i}/4 [00:0{i}<00:00,  1.00it/s]", flush=True)
    time.sleep(0.1)
if os.environ.get("HF_TOKEN") != "hf_test_token":
    sys.exit("no token")
"""


@pytest.mark.docker
def test_staging_runs_the_cli_in_a_helper_with_the_cache_and_token(
    docker_node: Node, stack: str, settings: object
) -> None:
    """Weights cannot be downloaded on these machines: the Hugging Face CLI is replaced by a
    script that prints its progress bar and writes 1 MB into the cache. What is tested is the
    orchestration: the helper container, the cache volume, HF_TOKEN, progress and size."""
    settings.TOLLGATE_STAGE_ENTRYPOINT = ["python3", "-c", FAKE_HF]
    settings.HF_TOKEN = "hf_test_token"
    model = services.create_model(
        None,
        served_name="m",
        source="org/model-x",
        params_billions=Decimal("1"),
        context_length=4096,
    )
    op = staging.stage_weights(None, model, docker_node, SIM_IMAGE)
    tasks.stage_weights(op.pk)
    op.refresh_from_db()
    assert op.status == OperationStatus.SUCCEEDED, op.error
    assert op.progress == 100 and "staged" in op.message
    staged = StagedModel.objects.get(model=model, node=docker_node)
    assert 1_000_000 <= staged.size_bytes < 1_100_000
    assert containers(stack) == []  # helpers are removed
    assert "hf_test_token" not in str(op.detail) + op.message


@pytest.mark.docker
def test_staging_failure_is_reported_with_the_log_tail(
    docker_node: Node, stack: str, settings: object
) -> None:
    """No network here: a download that fails (no token) must fail the operation clearly."""
    settings.TOLLGATE_STAGE_ENTRYPOINT = ["python3", "-c", FAKE_HF]
    settings.HF_TOKEN = ""
    model = services.create_model(
        None,
        served_name="m",
        source="org/model-y",
        params_billions=Decimal("1"),
        context_length=4096,
    )
    op = staging.stage_weights(None, model, docker_node, SIM_IMAGE)
    tasks.stage_weights(op.pk)
    op.refresh_from_db()
    assert op.status == OperationStatus.FAILED
    assert "exited with code 1" in op.error and "no token" in op.error
    assert not StagedModel.objects.exists() and containers(stack) == []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_external_engine_is_health_checked_routed_and_never_started(
    sim_model: CatalogModel, root: object, client_for: object
) -> None:
    """An engine Tollgate does not run (here the simulator as a plain process with a key)."""
    port = _free_port()
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine_sim",
            "Qwen/Qwen3-0.6B",
            "--served-model-name",
            "tiny-chat",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            "upstream-secret",
            "--sim-load-seconds",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        api = client_for(root)
        answer = api.post(
            "/api/v1/deployments/",
            {
                "name": "outside",
                "model": "tiny-chat",
                "external": True,
                "external_url": f"http://127.0.0.1:{port}/v1",
                "upstream_key": "upstream-secret",
                "engine_args": {"max-num-seqs": 16},
            },
            format="json",
        )
        assert answer.status_code == 201, answer.content
        assert "upstream_key" not in answer.json() and answer.json()["has_upstream_key"]
        assert "upstream-secret" not in api.get("/api/v1/audit/").content.decode()
        deployment = Deployment.objects.get(name="outside")
        assert not deployment.operations.exists()  # nothing to start

        replica = wait_for(
            lambda: fleet.check_external(deployment).healthy, 15
        ) and Replica.objects.get(deployment=deployment)
        assert replica.base_url == f"http://127.0.0.1:{port}"
        assert [u.base_url for u in load_snapshot().routes[sim_model.pk]] == [replica.base_url]
        figures = fleet.scrape_replica(replica)
        assert figures is not None and fleet.read_telemetry(replica.pk)["running"] == 0

        engine.send_signal(signal.SIGTERM)
        engine.wait(timeout=10)
        replica = fleet.check_external(deployment)
        assert not replica.healthy and "not reachable" in replica.last_error
        assert sim_model.pk not in load_snapshot().routes
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
