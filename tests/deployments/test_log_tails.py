"""Engine log tails reach the web process through Redis, never through Docker."""

import pytest
from django.core.exceptions import ValidationError

from core.redis import get_redis
from deployments import services
from deployments.fleet import log_key
from deployments.models import Deployment, Node, Replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def replica(public_model: object) -> Replica:
    node = Node.objects.create(name="far", docker_url="tcp://127.0.0.1:1", queue="node.far")
    deployment = Deployment.objects.create(
        name="far-dep", model=public_model, node=node, image="tollgate/engine-sim:latest"
    )
    return Replica.objects.create(
        deployment=deployment, index=0, node=node, container_name="tollgate-far-0"
    )


def test_the_web_process_reads_the_tail_its_node_published(replica: Replica) -> None:
    get_redis().set(log_key(replica.pk), "\n".join(f"line {n}" for n in range(1, 301)).encode())
    text = services.replica_logs(replica.deployment, 0, lines=3)
    assert text.splitlines() == ["line 298", "line 299", "line 300"]


def test_without_a_published_tail_and_no_docker_the_answer_says_when_it_comes(
    replica: Replica,
) -> None:
    with pytest.raises(ValidationError, match="has not been reported by its node yet"):
        services.replica_logs(replica.deployment, 0)


def test_engines_of_staged_models_load_offline(replica: Replica) -> None:
    from django.utils import timezone

    from deployments.engine_env import engine_environment
    from deployments.models import StagedModel

    deployment, node = replica.deployment, replica.node
    assert "HF_HUB_OFFLINE" not in engine_environment(deployment, node)
    StagedModel.objects.create(
        model=deployment.model, node=node, size_bytes=1, staged_at=timezone.now()
    )
    assert engine_environment(deployment, node)["HF_HUB_OFFLINE"] == "1"
