"""Joined nodes' credentials on the real Redis and database (no Docker): a join token is
spent once for a per-node Redis user that reaches only that node's keys, only its hash is
kept, and revoking it cuts the node off and drains its replicas."""

import hashlib
import json
import uuid

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils import timezone
from redis.exceptions import AuthenticationError, NoPermissionError

from core.redis import get_redis
from deployments import credentials, joining, reconcile, relay, services, tasks
from deployments.choices import NodeStatus
from deployments.models import Deployment, JoinToken, Node, Operation, Replica
from gateway.state import load_snapshot
from nodeagent import protocol
from tests.deployments.conftest import SIM_IMAGE
from tests.scaleout.conftest import GB

pytestmark = pytest.mark.django_db(transaction=True)


def _url() -> str:
    kwargs = get_redis().connection_pool.connection_kwargs
    return f"redis://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}/0"


def as_node(body: dict) -> redis.Redis:
    """A Redis connection logged in as the node, as its agent makes it."""
    return redis.Redis.from_url(
        _url(), username=body["redis_user"], password=body["redis_password"]
    )


def join(client: object, name: str) -> dict:
    """Create a token as the platform admin, then join with it as the agent does."""
    token = client.post("/api/v1/nodes/join-token/", {"node_name": name}, format="json")
    reply = type(client)().post(
        "/api/v1/nodes/join/",
        {"name": name, "engine_host": "10.0.0.2"},
        format="json",
        HTTP_AUTHORIZATION=f"Bearer {token.json()['token']}",
    )
    assert reply.status_code == 201, reply.content
    return reply.json()


def unique(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:6]}"


def test_joining_spends_the_token_once_and_keeps_only_the_credentials_hash(
    client_for: object, root: object
) -> None:
    admin = client_for(root)
    name = unique("spark")
    token = admin.post("/api/v1/nodes/join-token/", {"node_name": name}, format="json").json()
    agent = type(admin)()  # no session, no API key: the join token is the only credential
    body = {"name": name, "engine_host": "10.0.0.2"}
    bearer = {"HTTP_AUTHORIZATION": f"Bearer {token['token']}"}
    assert agent.post("/api/v1/nodes/join/", body, format="json").status_code == 401
    reply = agent.post("/api/v1/nodes/join/", body, format="json", **bearer)
    assert reply.status_code == 201
    joined = reply.json()
    password = joined["redis_password"]
    assert joined["redis_user"] == f"{settings.TOLLGATE_REDIS_PREFIX}-node-{name}"
    node = Node.objects.get(name=name)
    assert node.credential_hash == hashlib.sha256(password.encode()).hexdigest()
    assert (node.docker_url, node.queue) == (
        relay.node_url(name),
        settings.TOLLGATE_JOINED_NODE_QUEUE,
    )
    # Shown once: neither the node nor the API ever gives the password back.
    shown = admin.get(f"/api/v1/nodes/{name}/").content.decode()
    assert password not in shown and node.credential_hash not in shown
    stored = json.dumps(list(Node.objects.values()) + list(JoinToken.objects.values()), default=str)
    assert password not in stored
    # The token is spent: a second exchange (an attacker who read it later) is refused.
    again = agent.post("/api/v1/nodes/join/", body, format="json", **bearer)
    assert again.status_code == 400
    assert again["Content-Type"].startswith("application/problem+json")
    assert [e["field"] for e in again.json()["errors"]] == ["token"]
    assert as_node(joined).ping()


def test_a_wrong_or_foreign_token_is_refused_in_the_same_time_shape(
    client_for: object, root: object
) -> None:
    admin = client_for(root)
    name = unique("spark")
    token = admin.post("/api/v1/nodes/join-token/", {"node_name": name}, format="json").json()
    agent = type(admin)()
    for bad, who in [
        (token["token"][:-1] + ("A" if token["token"][-1] != "A" else "B"), name),  # one char off
        ("tgj-zzzzzzzz-" + "x" * 40, name),  # unknown prefix
        (token["token"], unique("other")),  # someone else's name
    ]:
        reply = agent.post(
            "/api/v1/nodes/join/",
            {"name": who, "engine_host": "h"},
            format="json",
            HTTP_AUTHORIZATION=f"Bearer {bad}",
        )
        assert reply.status_code == 400, bad
    assert not Node.objects.exists()


def test_verification_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token check goes through hmac.compare_digest even for an unknown prefix."""
    calls: list[tuple[str, str]] = []
    real = joining.hmac.compare_digest
    monkeypatch.setattr(
        joining.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b)
    )
    with pytest.raises(ValidationError):
        joining.exchange_join_token("tgj-zzzzzzzz-" + "x" * 40, "n", engine_host="h")
    assert len(calls) == 1 and calls[0][1] == "0" * 64


def test_a_nodes_credential_reaches_only_its_own_keys(client_for: object, root: object) -> None:
    admin = client_for(root)
    a, b = join(admin, unique("spark-a")), join(admin, unique("spark-b"))
    node_a = as_node(a)
    own = f"{a['key_base']}:rpc"
    # What the agent does works on its own keys.
    get_redis().lpush(own, "request")
    assert node_a.brpop([own], timeout=1) == (own.encode(), b"request")
    node_a.rpush(f"{a['key_base']}:reply:1", "x")
    node_a.expire(f"{a['key_base']}:reply:1", 30)
    node_a.set(protocol.facts_key(a["key_base"]), "{}", ex=30)
    # Another node's request list, reply lists and facts: NOPERM, so a node can neither
    # read another's work nor answer for it.
    get_redis().lpush(f"{b['key_base']}:rpc", "secret work")
    attempts = [
        lambda: node_a.brpop([f"{b['key_base']}:rpc"], timeout=1),
        lambda: node_a.rpush(f"{b['key_base']}:reply:1", "forged"),
        lambda: node_a.set(protocol.facts_key(b["key_base"]), "{}"),
        lambda: node_a.get(f"{b['key_base']}:rpc"),
        # Nothing of the control plane's or any tenant's either, and no way to look around.
        lambda: node_a.set(f"{settings.TOLLGATE_REDIS_PREFIX}:quota:1:1", "0"),
        lambda: node_a.brpop(["nodes", "control", "celery"], timeout=1),
        lambda: node_a.get(f"{a['key_base']}:rpc"),  # no reads beyond popping its own work
        lambda: node_a.keys("*"),
        lambda: node_a.scan(0),
        lambda: node_a.publish(f"{settings.TOLLGATE_REDIS_PREFIX}:changes", "x"),
        lambda: node_a.execute_command("ACL", "SETUSER", a["redis_user"], "+@all"),
        lambda: node_a.flushall(),
        lambda: node_a.config_get("*"),
    ]
    for attempt in attempts:
        with pytest.raises(NoPermissionError):
            attempt()
    assert get_redis().lrange(f"{b['key_base']}:rpc", 0, -1) == [b"secret work"]


def test_revoking_cuts_the_node_off_and_drains_its_replicas(
    client_for: object, root: object, small_model: object
) -> None:
    admin = client_for(root)
    name = unique("spark")
    joined = join(admin, name)
    node = Node.objects.get(name=name)
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now(), total_memory_bytes=64 * GB)
    deployment = services.create_deployment(
        None, name="tiny", model=small_model, node=node, image=SIM_IMAGE
    )
    Deployment.objects.filter(pk=deployment.pk).update(state="ready")
    Replica.objects.filter(deployment=deployment).update(
        state="ready", healthy=True, host="127.0.0.1", port=9, container_name="c"
    )
    assert load_snapshot().routes[small_model.pk]
    connected = as_node(joined)
    assert connected.ping()

    reply = admin.post(f"/api/v1/nodes/{name}/revoke/")
    assert reply.status_code == 200
    assert reply.json()["status"] == NodeStatus.REVOKED and reply.json()["revoked_at"]
    # Redis dropped the agent's live connection and refuses its password from now on.
    with pytest.raises((redis.ConnectionError, AuthenticationError)):
        connected.ping()
    with pytest.raises(AuthenticationError):
        as_node(joined).ping()
    replica = Replica.objects.get()
    assert not replica.healthy and "revoked" in replica.last_error
    assert not load_snapshot().routes.get(small_model.pk)
    # A reconcile pass that began before the revocation (its engine still answers) does
    # not route it back in.
    reconcile._set_health(replica, True)
    assert not Replica.objects.get().healthy
    # It stays revoked: no heartbeat, periodic pass or edit brings it back.
    tasks.reconcile_all()
    assert Node.objects.get(pk=node.pk).status == NodeStatus.REVOKED
    with pytest.raises(AuthenticationError):
        as_node(joined).ping()
    edit = admin.patch(f"/api/v1/nodes/{name}/", {"status": "online"}, format="json")
    assert edit.status_code == 409
    assert Node.objects.get(pk=node.pk).status == NodeStatus.REVOKED


def test_stopping_or_removing_a_deployment_on_a_revoked_node_does_not_wait_for_it(
    client_for: object, root: object, small_model: object
) -> None:
    """The revoked node's agent can do nothing more: no operation is queued for it, and the
    deployment is stopped (or gone) at once instead of hanging in "stopping"."""
    admin = client_for(root)
    name = unique("spark")
    join(admin, name)
    node = Node.objects.get(name=name)
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now(), total_memory_bytes=64 * GB)
    deployment = services.create_deployment(
        None, name="tiny", model=small_model, node=node, image=SIM_IMAGE
    )
    Deployment.objects.filter(pk=deployment.pk).update(state="ready")
    Replica.objects.filter(deployment=deployment).update(
        state="ready", healthy=True, host="127.0.0.1", port=9, container_name="c"
    )
    assert admin.post(f"/api/v1/nodes/{name}/revoke/").status_code == 200
    queued = Operation.objects.count()

    services.set_desired_state(None, Deployment.objects.get(pk=deployment.pk), "stopped")
    assert Deployment.objects.get(pk=deployment.pk).state == "stopped"
    assert Replica.objects.get(deployment=deployment).state == "stopped"
    assert Operation.objects.count() == queued
    tasks.reconcile_all()  # the periodic pass queues nothing for it either
    assert Operation.objects.count() == queued

    assert services.remove_deployment(None, Deployment.objects.get(pk=deployment.pk)) is None
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert not Replica.objects.filter(deployment_id=deployment.pk).exists()


def test_only_a_platform_admin_revokes_and_only_joined_nodes(
    client_for: object, root: object, alice: object, local_node: Node
) -> None:
    admin = client_for(root)
    name = unique("spark")
    join(admin, name)
    assert client_for(alice).post(f"/api/v1/nodes/{name}/revoke/").status_code in (403, 404)
    assert Node.objects.get(name=name).status == NodeStatus.ONLINE
    own_worker = admin.post(f"/api/v1/nodes/{local_node.name}/revoke/")
    assert own_worker.status_code == 409
    assert own_worker["Content-Type"].startswith("application/problem+json")


def test_the_periodic_pass_restores_node_users_a_redis_restart_lost(
    client_for: object, root: object
) -> None:
    joined = join(client_for(root), unique("spark"))
    get_redis().execute_command("ACL", "DELUSER", joined["redis_user"])  # as after a restart
    with pytest.raises(AuthenticationError):
        as_node(joined).ping()
    assert credentials.sync_acl_users() == 1
    assert as_node(joined).ping()


def test_deleting_a_joined_node_deletes_its_credential(client_for: object, root: object) -> None:
    admin = client_for(root)
    kept, gone = join(admin, unique("spark")), join(admin, unique("spark"))
    assert admin.delete(f"/api/v1/nodes/{gone['name']}/").status_code == 204
    with pytest.raises(AuthenticationError):
        as_node(gone).ping()
    # A user left behind (e.g. deleted while Redis was away) goes at the next pass; the
    # live node's stays.
    get_redis().execute_command("ACL", "SETUSER", gone["redis_user"], "on", "nopass")
    credentials.sync_acl_users()
    assert get_redis().acl_getuser(gone["redis_user"]) is None
    assert as_node(kept).ping()
