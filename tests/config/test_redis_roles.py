"""Each process role's Redis ACL user (config/redisacl.py), tried on a real redis-server that
loads the generated ACL file, as the appliance's Redis does: every role does what its process
really does (Celery workers consume, acknowledge and answer remote control; beat queues its
tasks; the usage consumer reads and acknowledges the usage stream) without one refusal in
Redis's ACL log, and is refused what belongs to another role.

The server is this module's own (a free loopback port, ended by its PID), so the tests can
read ``ACL LOG`` through an admin user added to the test's copy of the file only.
"""

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from django.conf import LazySettings

from config import redisacl
from config.celery import app
from core.redis import get_redis
from core.tasks import discover_tasks
from tests.databases import database_url
from tests.gateway.conftest import free_port, stop

ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"acl{secrets.token_hex(3)}"
NAMES = redisacl.Names(PREFIX, "batches")
ADMIN = ("probe-admin", secrets.token_hex(16))


@dataclass
class AclServer:
    """A throw-away redis-server with the appliance's users and their passwords."""

    port: int
    passwords: dict[str, str]

    def url(self, role: str) -> str:
        user = role if role != "admin" else ADMIN[0]
        password = self.passwords[role] if role != "admin" else ADMIN[1]
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role))

    def refusals(self) -> list[dict]:
        """Everything Redis refused since the last ``reset``, as its ACL log has it."""
        return self.client("admin").acl_log()

    def reset(self) -> None:
        self.client("admin").acl_log_reset()


def start_redis(acl_file: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--aclfile", str(acl_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert server.poll() is None, f"redis-server refused the ACL file:\n{server.stdout.read()}"
        try:
            redis.Redis(port=port).ping()
            return server
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    raise AssertionError("redis-server did not start")


def stop_and_read(process: subprocess.Popen) -> str:
    stop(process)
    return process.stdout.read()


def write_passwords(directory: Path) -> dict[str, str]:
    passwords = {role: secrets.token_urlsafe(18) for role in redisacl.PASSWORD_FILES}
    for role, name in redisacl.PASSWORD_FILES.items():
        (directory / name).write_text(passwords[role] + "\n")
    return passwords


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    directory = tmp_path_factory.mktemp("redis-acl")
    passwords = write_passwords(directory)
    acl_file = directory / "redis" / "users.acl"
    redisacl.write_acl_file(directory, acl_file, NAMES)
    with acl_file.open("a") as f:  # the test's own reader of ACL LOG
        f.write(f"user {ADMIN[0]} on >{ADMIN[1]} ~* &* +@all\n")
    port = free_port()
    server = start_redis(acl_file, port)
    try:
        yield AclServer(port, passwords)
    finally:
        stop(server)


@pytest.fixture
def acl(acl_server: AclServer) -> AclServer:
    acl_server.reset()
    return acl_server


@pytest.fixture
def as_role(acl: AclServer, settings: LazySettings) -> Iterator[Callable[[str], redis.Redis]]:
    """Point this process's Redis client (core.redis.get_redis) at the server as a role."""
    original = settings.REDIS_URL

    def become(role: str) -> redis.Redis:
        settings.REDIS_URL = acl.url(role)
        settings.TOLLGATE_REDIS_PREFIX = PREFIX
        get_redis.cache_clear()
        return get_redis()

    yield become
    settings.REDIS_URL = original  # before the suite's own clean-up uses the client again
    get_redis.cache_clear()


def attempt(client: redis.Redis, *command: object) -> str:
    try:
        client.execute_command(*command)
        return "ok"
    except redis.exceptions.NoPermissionError:
        return "refused"


def test_every_role_logs_in_and_strangers_may_only_ping(acl: AclServer) -> None:
    for role in redisacl.PASSWORD_FILES:
        assert acl.client(role).ping()
    assert acl.client("worker").acl_whoami() == "worker"
    stranger = redis.Redis(port=acl.port)
    assert stranger.ping()
    assert attempt(stranger, "GET", f"{PREFIX}:usage:events") == "refused"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=acl.port, username="worker", password="wrong").ping()


@pytest.mark.django_db
def test_usage_consumer_reads_and_acknowledges_the_stream_and_nothing_else(
    acl: AclServer, as_role: Callable[[str], redis.Redis]
) -> None:
    """The consumer's real loop (metering.ingest): group, read, store, ack, claim, trim. What
    it cannot do: append or delete usage, read other keys (keys' and tenants' counters,
    stored responses), queue tasks, tell gateways anything, touch users."""
    from core.keyspace import quota_key, usage_stream
    from metering import ingest

    usage = as_role("usage")
    acl.client("gateway").xadd(usage_stream(), {"e": b"{}"})  # one the gateway appended
    ingest.ensure_group()
    result = ingest.ingest_once("consumer-1", block_ms=0)
    assert (result.read, result.dead_letters) == (1, 1)  # stored (as malformed), then acked
    assert acl.client("admin").xpending(usage_stream(), ingest.GROUP)["pending"] == 0
    assert ingest.read_batch("consumer-2", block_ms=0, claim_idle_ms=0) == []  # XAUTOCLAIM
    ingest.trim_stream()
    assert acl.refusals() == []

    assert {
        "append": attempt(usage, "XADD", usage_stream(), "*", "e", "{}"),
        "delete_stream": attempt(usage, "DEL", usage_stream()),
        "quota": attempt(usage, "HGETALL", quota_key(1, "2026-11")),
        "stored_response": attempt(usage, "GET", f"{PREFIX}:resp:1:resp_x"),
        "deploy_queue": attempt(usage, "LPUSH", "control", "{}"),
        "invalidate": attempt(usage, "PUBLISH", f"{PREFIX}:gateway:invalidate", "x"),
        "acl": attempt(usage, "ACL", "SETUSER", "someone", "on"),
        "keys": attempt(usage, "KEYS", "*"),
    } == dict.fromkeys(
        ("append", "delete_stream", "quota", "stored_response", "deploy_queue", "invalidate",
         "acl", "keys"),
        "refused",
    )  # fmt: skip


def test_beat_queues_control_tasks_only(acl: AclServer) -> None:
    """Beat sends its periodic tasks (CELERY_BEAT_SCHEDULE) to the control queue through
    Celery, and reaches nothing else: no other queue, no Tollgate key."""
    from django.conf import settings

    discover_tasks()
    with app.connection_for_write(acl.url("beat")) as conn:
        for entry in settings.CELERY_BEAT_SCHEDULE.values():
            app.tasks[entry["task"]].apply_async(connection=conn, **entry.get("options", {}))
        for queue in ("batches", "nodes", "node.local"):
            with pytest.raises(Exception, match="no permissions"):
                app.tasks["metering.trim_usage_stream"].apply_async(queue=queue, connection=conn)
    assert acl.client("admin").llen("control") == len(settings.CELERY_BEAT_SCHEDULE)
    acl.client("admin").delete("control")
    beat = acl.client("beat")
    assert attempt(beat, "GET", f"{PREFIX}:usage:events") == "refused"
    assert attempt(beat, "PUBLISH", f"{PREFIX}:gateway:invalidate", "x") == "refused"
    assert attempt(beat, "FLUSHALL") == "refused"


def test_worker_manages_node_users_and_no_other_admin_command(acl: AclServer) -> None:
    """The worker's periodic pass restores and removes joined nodes' users
    (deployments/credentials.py), so it has those ACL subcommands; nothing else administrative,
    nothing dangerous, and no key outside Tollgate's prefix and its Celery queues."""
    from deployments import credentials

    worker, node_user = acl.client("worker"), f"{PREFIX}-node-x"
    rules = credentials.acl_rules("x", "0" * 64)
    worker.execute_command("ACL", "SETUSER", node_user, *rules)
    assert worker.acl_getuser(node_user)["enabled"]
    assert node_user.encode() in worker.acl_users() or node_user in worker.acl_users()
    worker.acl_deluser(node_user)
    worker.set(f"{PREFIX}:probe", "1")
    assert acl.refusals() == []
    for command in [
        ("CONFIG", "GET", "*"),
        ("ACL", "LIST"),
        ("ACL", "LOAD"),
        ("SHUTDOWN",),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("GET", "celery-task-meta-x"),
        ("GET", "tollgate-other:probe"),
    ]:
        assert attempt(worker, *command) == "refused", command
    for role in ("gateway", "beat", "batches", "usage"):
        assert attempt(acl.client(role), "ACL", "SETUSER", node_user, "on") == "refused", role


def test_batch_runner_has_its_queue_and_the_invalidation_channel_only(acl: AclServer) -> None:
    batches = acl.client("batches")
    batches.publish(f"{PREFIX}:gateway:invalidate", "x")  # a child key was issued
    batches.lpush("batches", "{}")
    acl.client("admin").delete("batches")
    assert acl.refusals() == []
    for command in [
        ("LPUSH", "control", "{}"),
        ("LPUSH", "node.local", "{}"),
        ("HGETALL", "unacked"),  # the worker's unacknowledged deploys
        ("GET", f"{PREFIX}:probe"),
        ("XRANGE", f"{PREFIX}:usage:events", "-", "+"),
        ("PUBLISH", f"{PREFIX}:adm:wake", "1"),
    ]:
        assert attempt(batches, *command) == "refused", command


@pytest.mark.parametrize(
    ("role", "queues", "publisher", "task", "args"),
    [
        ("worker", "control,nodes,node.local", "beat", "metering.trim_usage_stream", []),
        # A request for an adapter no engine holds: the gateway asks the worker to load it.
        ("worker", "demand,control", "gateway", "deployments.load_adapter", [0, 0]),
        ("batches", "batches", "gateway", "batches.run_batch", [0]),
    ],
)
@pytest.mark.django_db
def test_celery_worker_runs_as_its_role(
    acl: AclServer, role: str, queues: str, publisher: str, task: str, args: list
) -> None:
    """A real `celery worker` as the role's user, as compose/entrypoint.sh starts it: it
    declares its queues, answers remote control (the worker's health check, `celery inspect
    ping`, also as that user), takes a task queued by the process that queues it in the
    appliance, runs it and acknowledges it (its unacknowledged-message keys end empty), with
    no refusal in the ACL log."""
    discover_tasks()
    unacked = "unacked" if role == "worker" else redisacl.unacked_key("batches")
    env = {
        **os.environ,
        "REDIS_URL": acl.url(role),
        # Explicitly: tests/batches/conftest.py puts the suite's broker in this process's
        # environment, and a worker inheriting it listened there instead (and answered pings).
        "CELERY_BROKER_URL": acl.url(role),
        "DATABASE_URL": database_url(),
        "TOLLGATE_ENV": "test",
        "TOLLGATE_REDIS_PREFIX": PREFIX,
        "TOLLGATE_CELERY_UNACKED_KEY": unacked,
    }
    hostname = f"{role}@acltest"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--queues", queues,
         "--pool", "solo", "--hostname", hostname, "--without-gossip", "--without-mingle",
         "--loglevel", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    admin = acl.client("admin")
    # The worker service's health check (`tollgate worker-ping`), as the same user.
    ping = [sys.executable, "-m", "celery", "-A", "config", "inspect", "ping", "-d", hostname,
            "--timeout", "2"]  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while subprocess.run(ping, cwd=ROOT, env=env, capture_output=True).returncode != 0:
            assert worker.poll() is None and time.monotonic() < deadline, stop_and_read(worker)
        with app.connection_for_write(acl.url(publisher)) as conn:
            app.tasks[task].apply_async(args=args, queue=queues.split(",")[0], connection=conn)
        deadline = time.monotonic() + 30
        while admin.llen(queues.split(",")[0]) or admin.hlen(unacked):
            assert time.monotonic() < deadline, "the task was never taken and acknowledged"
            time.sleep(0.1)
        # The message went from the queue to the unacked hash to nowhere: seen in between.
        assert admin.zcard(f"{unacked}_index") == 0
    finally:
        stop(worker)
    log = worker.stdout.read()
    assert "NOPERM" not in log and "no permissions" not in log, log
    assert acl.refusals() == []


def unordered(user: dict) -> dict:
    """ACL GETUSER's answer, its lists' order aside (Redis lists subcommands unordered)."""
    return {k: sorted(map(str, v)) if isinstance(v, list) else v for k, v in user.items()}


def test_applying_users_to_a_redis_that_started_with_an_older_file(tmp_path: Path) -> None:
    """A Redis that kept running through an upgrade knows only the users of its older ACL
    file: ``migrate`` (as the control plane) applies the role users, leaves joined nodes'
    users alone, and applying again changes nothing."""
    passwords = write_passwords(tmp_path)
    old = tmp_path / "old.acl"
    lines = redisacl.acl_lines(tmp_path, NAMES)
    old.write_text("\n".join(line for line in lines if line.split()[1] in ("default", "tollgate")))
    port = free_port()
    server = start_redis(old, port)
    try:
        url = f"redis://tollgate:{passwords['tollgate']}@127.0.0.1:{port}/0"
        control_plane = redis.Redis.from_url(url)
        control_plane.execute_command("ACL", "SETUSER", f"{PREFIX}-node-a", "on", "nopass")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="worker", password=passwords["worker"]).ping()
        for _ in range(2):
            applied = redisacl.apply_users(control_plane, tmp_path, NAMES)
        assert applied == ["gateway", "worker", "beat", "batches", "usage"]
        usage = redis.Redis(port=port, username="usage", password=passwords["usage"])
        assert usage.ping()
        assert attempt(usage, "XLEN", f"{PREFIX}:usage:events") == "refused"  # not its command
        usage.xgroup_create(f"{PREFIX}:usage:events", "metering", mkstream=True)
        assert attempt(usage, "GET", f"{PREFIX}:probe") == "refused"
        assert control_plane.acl_getuser(f"{PREFIX}-node-a")["enabled"]
        # Exactly the file's rules: what Redis reports for each user matches a fresh load.
        fresh_file = tmp_path / "fresh.acl"
        fresh_file.write_text("\n".join(lines) + "\n")
        fresh_port = free_port()
        fresh = start_redis(fresh_file, fresh_port)
        try:
            reference = redis.Redis(
                port=fresh_port, username="tollgate", password=passwords["tollgate"]
            )
            for role in applied:
                got, want = control_plane.acl_getuser(role), reference.acl_getuser(role)
                assert unordered(got) == unordered(want), role
        finally:
            stop(fresh)
    finally:
        stop(server)
