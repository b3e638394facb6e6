"""The consumer as a real process (manage.py consume_usage): killed with SIGKILL mid-batch,
and cut off from PostgreSQL for a while. Nothing is lost and nothing is counted twice.

PostgreSQL is shared with other test runs, so it is never stopped: the consumer reaches it
through a TCP proxy on a loopback port that the test closes and reopens.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import Sum

from core.keyspace import usage_stream
from core.redis import get_redis
from metering import ingest
from metering.models import UsageEvent, UsageRollup
from tests.databases import database_url
from tests.metering.conftest import emit, record

BASE_DIR = Path(settings.BASE_DIR)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.1)


def stored() -> int:
    return UsageEvent.objects.count()


def not_acked() -> int:
    """Entries of the stream the metering group has not acknowledged (pending + new)."""
    client = get_redis()
    (group,) = client.xinfo_groups(usage_stream())
    return group["pending"] + (group["lag"] or 0)


class Proxy:
    """A TCP proxy on a loopback port that can be closed and reopened on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, 0
        self.sockets: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port, self.listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        """Refuse new connections and cut the open ones, as a database going away would."""
        if self.listener:
            self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.sockets = []


@pytest.fixture
def consumer(redis_namespace: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def start(
        *args: str, db_url: str | None = None, pause_before_commit: float = 0
    ) -> subprocess.Popen:
        db = connection.settings_dict
        env = {
            **os.environ,
            "DATABASE_URL": db_url
            or database_url(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)),
            "TOLLGATE_REDIS_PREFIX": redis_namespace,
            "REDIS_URL": settings.REDIS_URL,
        }
        log = open(tmp_path / f"consumer-{len(started)}.log", "wb")  # noqa: SIM115
        command = [sys.executable, "manage.py", "consume_usage"]
        if pause_before_commit:  # the pause is patched in by tests/faults/paused_consumer.py
            command = [
                sys.executable,
                "-m",
                "tests.faults.paused_consumer",
                str(pause_before_commit),
            ]
        proc = subprocess.Popen(
            [*command, "--block-ms", "200", "--claim-idle-ms", "500", *args],
            cwd=BASE_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log.name
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.django_db(transaction=True)
def test_kill_9_mid_batch_then_restart_loses_nothing_and_doubles_nothing(
    consumer, tenant_a, key_a, public_model, price
) -> None:
    records = [record(tenant_a, public_model, key_a) for _ in range(2500)]
    emit(*records)
    first = consumer("--batch", "1000", pause_before_commit=30)
    wait_for(lambda: b"pausing before commit" in Path(first.log_path).read_bytes())

    os.kill(first.pid, signal.SIGKILL)  # inside the transaction, rows inserted, no commit
    first.wait()
    assert stored() == 0 and not_acked() == 2500

    consumer("--batch", "1000")  # a new process: claims the dead one's pending entries
    wait_for(lambda: not_acked() == 0 and stored() == 2500)

    assert set(UsageEvent.objects.values_list("request_id", flat=True)) == {
        r.request_id for r in records
    }
    assert UsageRollup.objects.aggregate(n=Sum("requests"))["n"] == 2500
    assert get_redis().xpending(usage_stream(), ingest.GROUP)["pending"] == 0


@pytest.mark.django_db(transaction=True)
def test_events_wait_in_redis_while_postgresql_is_unreachable_and_land_afterwards(
    consumer, tenant_a, key_a, public_model, price
) -> None:
    db = connection.settings_dict
    proxy = Proxy((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
    proxy.start()
    proc = consumer("--batch", "200", db_url=database_url("127.0.0.1", proxy.port))
    emit(*[record(tenant_a, public_model, key_a) for _ in range(300)])
    wait_for(lambda: stored() == 300 and not_acked() == 0)

    def failures() -> int:
        return Path(proc.log_path).read_bytes().count(b"database unavailable")

    proxy.stop()
    seen = failures()
    emit(*[record(tenant_a, public_model, key_a) for _ in range(700)])
    # The consumer has tried and failed (its log says so), and keeps the batch unacknowledged.
    wait_for(lambda: failures() > seen)
    assert stored() == 300 and not_acked() == 700
    assert get_redis().xlen(usage_stream()) == 1000
    assert proc.poll() is None  # still running, backing off

    proxy.start()  # same port
    wait_for(lambda: stored() == 1000 and not_acked() == 0)
    assert UsageRollup.objects.aggregate(n=Sum("requests"))["n"] == 1000
    assert b"database unavailable" in Path(proc.log_path).read_bytes()
    proxy.stop()
