"""Placement, node failure marking, join tokens and Ray group settings, on the database
(no Docker): the rules the two-node Docker tests then exercise end to end."""

from datetime import timedelta
from decimal import Decimal

import pytest
import time_machine
from django.core.exceptions import ValidationError
from django.utils import timezone

from deployments import cluster, fleet, joining, placement, services
from deployments.choices import NodeStatus, ReplicaState
from deployments.models import Deployment, EngineProfile, JoinToken, Node, Replica
from deployments.profiles import ensure_builtin_profiles
from gateway.state import load_snapshot
from tests.scaleout.conftest import GB

pytestmark = pytest.mark.django_db


def node(name: str, limit: int, **fields: object) -> Node:
    fields.setdefault("last_seen_at", timezone.now())
    fields.setdefault("unified_memory", True)
    return services.register_node(
        None,
        name=name,
        docker_url="unix:///nowhere",
        engine_host="127.0.0.1",
        memory_limit_bytes=limit,
        **fields,
    )


@pytest.fixture
def model() -> object:
    return services.create_model(
        None,
        served_name="m",
        source="org/m",
        params_billions=Decimal("1"),
        context_length=4096,
        kv_bytes_per_token=1024,
    )


def unpinned(model: object, replicas: int = 1, **fields: object) -> Deployment:
    fields.setdefault("engine_args", {"max-num-seqs": 4, "max-model-len": 4096})
    return Deployment.objects.create(
        name=f"d{Deployment.objects.count()}",
        model=model,
        image="tollgate/engine-sim:latest",
        replicas=replicas,
        **fields,
    )


def test_a_moved_replica_counts_the_replicas_staying_on_its_new_node(model: object) -> None:
    """~3.1 GB each: a (4 GB) holds replica 1 already, so replica 0, leaving a revoked or
    unreachable b, does not fit there (it once did: staying replicas were not counted)."""
    a, b = node("a", 4 * GB), node("b", 7 * GB)
    deployment = unpinned(model, replicas=2)
    Replica.objects.create(deployment=deployment, index=0, node=b)
    Replica.objects.create(deployment=deployment, index=1, node=a)
    Node.objects.filter(pk=b.pk).update(status=NodeStatus.REVOKED)
    with pytest.raises(placement.NoRoom, match="a: needs"):
        placement.place(deployment)
    assert Replica.objects.get(index=0).node == b


def test_placement_picks_the_node_with_most_free_memory_that_fits(model: object) -> None:
    small, large = node("small", 4 * GB), node("large", 7 * GB)
    node("silent", 100 * GB, last_seen_at=timezone.now() - timedelta(minutes=5))
    node("never-joined", 100 * GB, last_seen_at=None)
    deployment = unpinned(model, replicas=2)
    placement.place(deployment)
    # ~3.1 GB each: the first on the larger node; then 3.9 GB are left there, 4 GB on the other.
    assert [r.node.name for r in deployment.replica_set.order_by("index")] == ["large", "small"]
    # Two more: the third fits on "large" (3.9 GB free), the fourth nowhere: refused with the sums.
    with pytest.raises(placement.NoRoom, match="small: needs 3.2 GB, 0.8 GB free"):
        placement.check_placeable(unpinned(model, replicas=2))
    placement.check_placeable(unpinned(model, replicas=1))
    assert small.pk and large.pk


def test_a_replica_too_big_for_the_roomier_node_goes_where_it_fits(model: object) -> None:
    node("a", 4 * GB)
    node("b", 7 * GB)
    unpinned(model)  # takes 3.1 GB of b when placed
    placement.place(Deployment.objects.get())
    big = services.create_model(
        None,
        served_name="big",
        source="org/big",
        params_billions=Decimal("1.4"),
        context_length=4096,
        kv_bytes_per_token=1024,
    )
    deployment = unpinned(big)  # ~3.9 GB: b has 3.9 GB left minus a little, a has 4 GB
    placement.place(deployment)
    assert deployment.replica_set.get().node.name == "a"


def test_unreachable_node_leaves_routing_at_once_and_unpinned_replicas_move(model: object) -> None:
    a, b = node("a", 7 * GB), node("b", 7 * GB)
    deployment = unpinned(model, desired_state="running", state="ready")
    Replica.objects.create(
        deployment=deployment,
        index=0,
        node=a,
        host="127.0.0.1",
        port=9,
        state=ReplicaState.READY,
        healthy=True,
    )
    assert len(load_snapshot().routes[model.pk]) == 1
    with time_machine.travel(timezone.now() + timedelta(seconds=31)):
        Node.objects.filter(pk=b.pk).update(last_seen_at=timezone.now())
        assert fleet.mark_silent_nodes() == 1
        assert fleet.mark_silent_nodes() == 0  # once
        assert Node.objects.get(pk=a.pk).status == NodeStatus.UNREACHABLE
        assert model.pk not in load_snapshot().routes
        replica = Replica.objects.get()
        assert "node a unreachable: no heartbeat for more than 30 s" in replica.last_error
        moved = placement.place(deployment)
    assert [(r.node.name, r.state, r.port) for r in moved] == [("b", ReplicaState.PENDING, None)]


def test_pinned_replicas_stay_on_their_node_when_it_is_unreachable(model: object) -> None:
    a = node("a", 7 * GB, status=NodeStatus.UNREACHABLE)
    node("b", 7 * GB)
    deployment = unpinned(model, node=a)
    Replica.objects.create(deployment=deployment, index=0, node=a, state=ReplicaState.READY)
    assert placement.place(deployment) == []


def test_join_token_is_spent_once_for_a_node_driven_through_its_agent(settings: object) -> None:
    issued = joining.create_join_token(None, "spark-2", control_plane="http://10.0.0.1")
    assert issued.token.startswith("tgj-") and "TOLLGATE_NODE_NAME=spark-2" in issued.command
    assert "TOLLGATE_CONTROL_PLANE_URL=http://10.0.0.1" in issued.command
    assert issued.token in issued.command
    assert "SECRET_KEY" not in issued.command and "DB_PASSWORD" not in issued.command
    row = JoinToken.objects.get()
    assert issued.token not in row.secret_hash and row.prefix in issued.token
    with pytest.raises(ValidationError):
        joining.exchange_join_token(issued.token, "spark-3", engine_host="10.0.0.2")
    with pytest.raises(ValidationError):
        wrong = issued.token[:-1] + ("y" if issued.token.endswith("x") else "x")
        joining.exchange_join_token(wrong, "spark-2", engine_host="10.0.0.2")
    joined = joining.exchange_join_token(
        issued.token, "spark-2", engine_host="10.0.0.2", high_speed_interface="enp1s0f1np1"
    )
    node = joined.node
    assert (node.queue, node.docker_url, node.engine_host, node.high_speed_interface) == (
        settings.TOLLGATE_JOINED_NODE_QUEUE,
        "tollgate-node://spark-2",
        "10.0.0.2",
        "enp1s0f1np1",
    )
    # Spent: the same token never gives out a second credential.
    with pytest.raises(ValidationError, match="used"):
        joining.exchange_join_token(issued.token, "spark-2", engine_host="10.0.0.2")
    with pytest.raises(ValidationError, match="joined already"):
        joining.create_join_token(None, "spark-2")


def test_join_token_expires_unused() -> None:
    issued = joining.create_join_token(None, "spark-9")
    with time_machine.travel(timezone.now() + timedelta(hours=25)):
        with pytest.raises(ValidationError):
            joining.exchange_join_token(issued.token, "spark-9", engine_host="10.0.0.3")
    assert not Node.objects.filter(name="spark-9").exists()


def test_two_box_tensor_parallel_needs_a_ray_profile_and_two_nodes(model: object) -> None:
    ensure_builtin_profiles()
    a, b = node("a", 100 * GB), node("b", 100 * GB)
    args = {"tensor-parallel-size": 2, "max-num-seqs": 4}
    with pytest.raises(ValidationError, match="needs a profile that starts a Ray group"):
        services.create_deployment(
            None,
            name="tp",
            model=model,
            node=a,
            worker_node=b,
            image="tollgate/engine-sim:latest",
            engine_args=args,
        )
    sim = EngineProfile.objects.get(name="simulator")
    with pytest.raises(ValidationError, match="second node"):
        services.create_deployment(
            None, name="tp", model=model, node=a, worker_node=a, profile=sim, engine_args=args
        )
    with pytest.raises(ValidationError, match="at most two nodes"):
        services.create_deployment(
            None,
            name="tp",
            model=model,
            node=a,
            profile=sim,
            engine_args={**args, "tensor-parallel-size": 4},
        )


def test_ray_group_environment_follows_the_node_settings() -> None:
    spark = node(
        "spark-1", 0, high_speed_interface="enp1s0f1np1", high_speed_address="192.168.100.1"
    )
    assert cluster.node_env(spark) == {
        "VLLM_HOST_IP": "192.168.100.1",
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "UCX_NET_DEVICES": "enp1s0f1np1",
        "RAY_memory_usage_threshold": "1.0",
    }
    plain = node("box", 0, unified_memory=False)
    assert cluster.node_env(plain) == {"VLLM_HOST_IP": "127.0.0.1"}
    assert cluster.head_command(["m", "--tensor-parallel-size", "2"])[-2:] == [
        "--distributed-executor-backend",
        "ray",
    ]


def test_dgx_spark_profile_starts_ray_then_vllm_serve_on_the_host_network() -> None:
    ensure_builtin_profiles()
    spark = EngineProfile.objects.get(name="dgx-spark")
    deployment = Deployment(profile=spark)
    head = cluster.head_entrypoint(deployment)
    assert head[:2] == ["bash", "-c"] and 'exec vllm serve "$@"' in head[2]
    assert "ray start --head --port=6379" in head[2] and "-ge 2" in head[2]
    assert cluster.settings_for(deployment)["network"] == "host"
