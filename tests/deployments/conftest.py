"""Fixtures for deployment tests: a node on the local Docker Engine, reached through the
Docker API policy (``dockerpolicy``, as the appliance's ``docker-proxy``), fast timings, and
clean-up by label so a failing test leaves no container, volume or network behind."""

from collections.abc import Iterator
from decimal import Decimal

import docker
import pytest
from django.conf import settings as django_settings

from config.celery import app as celery_app
from deployments import runtime
from deployments import services as deployment_services
from deployments.models import CatalogModel, Node
from tests import leaks
from tests.dockerpolicy.process import policy_env, start_policy

SIM_IMAGE = "tollgate/engine-sim:latest"


@pytest.fixture
def stack(
    settings: object, request: pytest.FixtureRequest, stack_volumes: tuple[str, str] | None
) -> Iterator[str]:
    """A stack id, cache volumes, engine network and fast timings of this test's own, and
    the Docker API policy for them in front of the Docker socket: every Docker call of the
    test's nodes goes through it, and none may be refused. Cleaned up after (volumes given
    by ``stack_volumes`` are not the stack's, so they are kept)."""
    stack_id = leaks.unique_name("tgtest")
    models, compile_cache = stack_volumes or (f"{stack_id}-models", f"{stack_id}-compile")
    settings.TOLLGATE_STACK_ID = stack_id
    settings.TOLLGATE_MODEL_CACHE_VOLUME = models
    settings.TOLLGATE_COMPILE_CACHE_VOLUME = compile_cache
    settings.TOLLGATE_ENGINE_NETWORK = f"{stack_id}-net"
    # The policy allows exactly the volumes the stack's engines mount.
    env = policy_env(
        stack_id,
        list(settings.TOLLGATE_ENGINE_IMAGES),
        TOLLGATE_MODEL_CACHE_VOLUME=models,
        TOLLGATE_COMPILE_CACHE_VOLUME=compile_cache,
    )
    policy = start_policy(env, f"{request.node.name}-{stack_id}")
    settings.TOLLGATE_DOCKER_URL = policy.url
    settings.TOLLGATE_PULL_POLICY = "never"
    settings.TOLLGATE_ENGINE_POLL_SECONDS = 0.1
    settings.TOLLGATE_ENGINE_READY_TIMEOUT = 60.0
    settings.TOLLGATE_RESTART_BACKOFF_SECONDS = 0.5
    settings.TOLLGATE_RESTART_BACKOFF_MAX_SECONDS = 2.0
    settings.TOLLGATE_MAX_CRASHES = 3
    settings.TOLLGATE_ORPHAN_GRACE_SECONDS = 0.0
    settings.TOLLGATE_DRAIN_TIMEOUT = 10.0
    settings.TOLLGATE_STOP_GRACE_SECONDS = 3
    try:
        yield stack_id
    finally:
        policy.stop()
        client = docker.from_env()
        for container in client.containers.list(
            all=True, filters={"label": f"{runtime.LABEL_STACK}={stack_id}"}, ignore_removed=True
        ):
            container.remove(force=True)
        for name in (f"{stack_id}-models", f"{stack_id}-compile"):
            try:
                client.volumes.get(name).remove(force=True)
            except docker.errors.NotFound:
                pass
        for network in client.networks.list(names=[f"{stack_id}-net"]):
            network.remove()
    refused = policy.refusals()
    assert not refused, f"the Docker API policy refused calls of Tollgate's own: {refused}"


@pytest.fixture
def eager_tasks() -> Iterator[None]:
    """Queued tasks run inline once the transaction commits (no worker in these tests)."""
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


@pytest.fixture
def docker_node(transactional_db: None, stack: str) -> Node:
    """The local Docker Engine as a node; engines publish their port on loopback only."""
    return deployment_services.register_node(
        None,
        name=f"n-{stack[-10:]}",
        docker_url=django_settings.TOLLGATE_DOCKER_URL,
        engine_host="127.0.0.1",
        total_memory_bytes=64 * 2**30,
        queue=f"node.{stack}",
    )


@pytest.fixture
def sim_model(transactional_db: None) -> CatalogModel:
    return deployment_services.create_model(
        None,
        served_name="tiny-chat",
        source="Qwen/Qwen3-0.6B",
        params_billions=Decimal("0.6"),
        context_length=4096,
    )


def sim_env(**extra: str) -> dict[str, str]:
    """Simulator knobs through the ordinary, allow-listed engine environment."""
    return {
        "SIM_LOAD_SECONDS": "0.4",
        "SIM_SHARDS": "4",
        "SIM_DECODE_TPS": "0",
        "SIM_TTFT_MS": "1",
        **extra,
    }
