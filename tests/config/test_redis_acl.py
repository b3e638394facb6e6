"""The Redis ACL users of the appliance (config/redisacl.py), tried on the real Redis: the
gateway's rules let it use Tollgate's keys and the batch queue, and nothing else."""

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from config import redisacl

PREFIX = f"acltest-{secrets.token_hex(4)}"
BATCHES = f"{PREFIX}-batches"
DEMANDS = f"{PREFIX}-demand"


@pytest.fixture
def gateway_user() -> Iterator[tuple[str, str]]:
    admin = redis.Redis(host="127.0.0.1", port=6379)
    user, password = f"tollgate-test-gw-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    admin.acl_setuser(user, enabled=True, reset=True)
    admin.execute_command(
        "ACL", "SETUSER", user, f">{password}", *redisacl.gateway_rules(PREFIX, BATCHES, DEMANDS)
    )
    try:
        yield user, password
    finally:
        admin.acl_deluser(user)
        # Only this test's keys: the shared Redis holds other runs' queues ("control" too).
        bindings = [key for q in (BATCHES, DEMANDS) for key in admin.keys(f"_kombu.binding*{q}")]
        admin.delete(f"{PREFIX}:probe", BATCHES, DEMANDS, *bindings)


def test_gateway_user_can_queue_a_batch_job(gateway_user: tuple[str, str]) -> None:
    """What /v1/batches does after creating a batch: Celery declares the queue (priority
    lists, bindings) and pushes the message, all allowed to the gateway user."""
    from batches.services import RUN_TASK
    from config.celery import app
    from core.tasks import discover_tasks

    discover_tasks()
    user, password = gateway_user
    with app.connection_for_write(f"redis://{user}:{password}@127.0.0.1:6379/0") as conn:
        app.tasks[RUN_TASK].apply_async(args=[1], queue=BATCHES, connection=conn)
        # And what a request for an adapter no engine holds does: ask for its load.
        app.send_task("deployments.load_adapter", args=[1, 2], queue=DEMANDS, connection=conn)
        with pytest.raises(Exception, match="NOPERM|no permissions"):
            app.tasks[RUN_TASK].apply_async(args=[1], queue="control", connection=conn)
    assert redis.Redis().llen(BATCHES) == 1 and redis.Redis().llen(DEMANDS) == 1


@pytest.fixture
def gateway_client() -> Iterator[redis.Redis]:
    admin = redis.Redis(host="127.0.0.1", port=6379)
    user, password = f"tollgate-test-gw-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    admin.acl_setuser(user, enabled=True, reset=True)  # an empty user first, then the rules
    admin.execute_command(
        "ACL", "SETUSER", user, f">{password}", *redisacl.gateway_rules(PREFIX, f"{PREFIX}-batches")
    )
    client = redis.Redis(host="127.0.0.1", port=6379, username=user, password=password)
    try:
        yield client
    finally:
        client.close()
        admin.acl_deluser(user)
        admin.delete(f"{PREFIX}:probe", f"{PREFIX}-batches")


def test_gateway_user_reaches_its_keys_and_nothing_else(gateway_client: redis.Redis) -> None:
    gateway_client.set(f"{PREFIX}:probe", "1")
    assert gateway_client.get(f"{PREFIX}:probe") == b"1"
    gateway_client.lpush(f"{PREFIX}-batches", "job")  # queuing a Batch API job
    gateway_client.publish(f"{PREFIX}:gateway:invalidate", "x")
    for command in (
        ("GET", "tollgate-other:probe"),
        ("LPUSH", "control", "{}"),
        ("LPUSH", "node.local", "{}"),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("CONFIG", "GET", "*"),
        ("ACL", "LIST"),
        ("PUBLISH", "elsewhere", "x"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway_client.execute_command(*command)


def test_acl_file_holds_hashes_not_passwords(tmp_path: Path) -> None:
    for role, name in redisacl.PASSWORD_FILES.items():
        (tmp_path / name).write_text(f"{role}-secret\n")
    redisacl.write_acl_file(tmp_path, tmp_path / "redis" / "users.acl", redisacl.Names())
    lines = (tmp_path / "redis" / "users.acl").read_text().splitlines()
    assert not any("secret" in line for line in lines)
    assert lines[0] == "user default on nopass resetkeys resetchannels -@all +ping"
    users = {line.split()[1]: line.split()[3:] for line in lines[1:]}
    assert list(users) == ["tollgate", "gateway", "worker", "beat", "batches", "usage"]
    assert all(line.split()[2] == "on" and line.split()[3].startswith("#") for line in lines[1:])


def test_each_role_gets_only_its_keys_channels_and_commands() -> None:
    """The generated rules, role by role (the real server's tests prove them sufficient)."""
    names = redisacl.Names("tg", "batches")
    rules = {role: redisacl.role_rules(role, names) for role in redisacl.PASSWORD_FILES}
    assert rules["tollgate"][:2] == ["~*", "&*"]
    for role in ("gateway", "worker", "beat", "batches", "usage"):
        assert rules[role][:2] == ["resetkeys", "resetchannels"], role
        assert "~*" not in rules[role] and "&*" not in rules[role], role
        assert "-@dangerous" in rules[role] and "-@admin" in rules[role], role
    # Only the control plane and the worker (which restores joined nodes' users) manage users.
    managers = {role for role, r in rules.items() if "+acl|setuser" in r}
    assert managers == {"tollgate", "worker"}
    assert "~tg:*" in rules["gateway"] and "~tg:*" in rules["worker"]
    assert not [r for r in rules["beat"] if r.startswith("~tg") or r.startswith("&")]
    assert "~control" in rules["beat"] and "~batches" not in rules["beat"]
    assert [r for r in rules["usage"] if r[0] in "~&"] == ["~tg:usage:events"]
    assert "+xreadgroup" in rules["usage"] and "+@all" not in rules["usage"]
    assert [r for r in rules["batches"] if r.startswith("~tg") or r.startswith("&tg")] == [
        "&tg:gateway:invalidate"
    ]
    assert "~unacked.batches" in rules["batches"] and "~unacked" not in rules["batches"]
    for role in ("gateway", "beat", "usage"):
        assert "~control" not in rules[role] or role == "beat"
        assert not [r for r in rules[role] if "unacked" in r or "pidbox" in r], role


def test_the_control_plane_user_manages_node_users_but_no_other_admin_command() -> None:
    """It makes and removes joined nodes' users (deployments/credentials.py) and still
    cannot reconfigure or stop Redis."""
    admin = redis.Redis(host="127.0.0.1", port=6379)
    user, password, node_user = f"{PREFIX}-cp", secrets.token_hex(16), f"{PREFIX}-node-x"
    admin.execute_command(
        "ACL", "SETUSER", user, "reset", "on", f">{password}", "~*", "&*",
        *redisacl.CONTROL_PLANE.split(),
    )  # fmt: skip
    try:
        control_plane = redis.Redis(host="127.0.0.1", port=6379, username=user, password=password)
        control_plane.execute_command("ACL", "SETUSER", node_user, "reset", "on", "nopass")
        assert control_plane.acl_getuser(node_user)["enabled"]
        assert node_user in control_plane.acl_users()
        control_plane.execute_command("ACL", "DELUSER", node_user)
        assert admin.acl_getuser(node_user) is None
        for command in [("CONFIG", "GET", "*"), ("ACL", "LIST"), ("SHUTDOWN",), ("MONITOR",)]:
            with pytest.raises(redis.exceptions.NoPermissionError):
                control_plane.execute_command(*command)
    finally:
        admin.acl_deluser(user, node_user)
