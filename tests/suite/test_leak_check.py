"""The session-end check of tests/conftest.py fails a stage that leaves something behind.

Each case runs tests of leak_cases.py in a pytest session of its own (a subprocess, with
the repository's real conftest), then checks that session failed and named the leftover.
The leftover is then removed by this test: the process by its PID, Docker objects by their
names; the check itself has already ended the database session. Each child session has a run
token of its own (``nested_run``), so Docker objects count for it only when it created them.
"""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import leaks

ROOT = Path(__file__).resolve().parents[2]


def nested_run() -> str:
    """A run token for a child session: its own, so it counts only what it creates itself,
    and this run's with a suffix, so whatever it leaves counts as this run's too."""
    return leaks.RUN + uuid.uuid4().hex[:4]


def session(*args: str, **env: str) -> subprocess.CompletedProcess:
    """A pytest session of its own, on a test database and with a run token of its own."""
    database = f"{os.environ.get('TOLLGATE_TEST_DATABASE') or 'test_tollgate'}_leak"
    env.setdefault("TOLLGATE_TEST_RUN", nested_run())
    return subprocess.run(
        # Without migrations: these sessions need a test database, not the schema's history.
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", "--no-migrations"],
        cwd=ROOT,
        env={
            **os.environ,
            "TOLLGATE_LEAK_GRACE_SECONDS": "1",
            "TOLLGATE_TEST_DATABASE": database,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=240,
    )


def run_case(*names: str, **env: str) -> subprocess.CompletedProcess:
    cases = [f"tests/suite/leak_cases.py::{name}" for name in names]
    return session(*cases, TOLLGATE_LEAK_CASE="1", **env)


def test_a_leftover_child_process_fails_the_session(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    result = run_case("test_leaves_a_child_process", TOLLGATE_LEAK_PIDFILE=str(pidfile))
    pid = int(pidfile.read_text())
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        assert "1 passed, 1 error" in result.stdout
        assert "the test session left behind" in result.stdout
        assert f"process {pid} " in result.stdout and "sleep 600" in result.stdout
        # The check also ended it, so it does not outlive the session.
        assert leaks.settle(lambda: [] if not alive(pid) else [str(pid)], 10) == []
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_leftover_database_connection_fails_the_session(tmp_path: Path) -> None:
    result = run_case("test_leaves_a_database_connection")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "left connections to the test database open" in result.stdout
    assert "app='tollgate-leak-case'" in result.stdout
    # The check ended that session, so the test database could still be dropped.
    assert "being accessed by other users" not in result.stdout + result.stderr


def test_a_clean_session_passes(tmp_path: Path) -> None:
    """A session that starts a process and opens a database connection, and ends both, passes:
    the check fails only on leftovers."""
    result = run_case("test_closes_what_it_opens")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.docker
def test_leftover_docker_objects_of_the_run_fail_the_session_and_a_neighbour_s_do_not() -> None:
    """The session leaves a network named with its run's token and a volume labelled with it,
    and meanwhile "another process" leaves a container, a network and a volume without the
    token (named and labelled like another Tollgate's): the check names the run's two only."""
    run = nested_run()
    ours = f"tgleak-{run}-{uuid.uuid4().hex[:8]}"
    volume = f"tgleak-{uuid.uuid4().hex[:10]}"  # the token only in its label
    neighbour = f"tollgate-neighbour-{uuid.uuid4().hex[:10]}"
    result = run_case(
        "test_leaves_docker_objects",
        "test_a_neighbour_leaves_docker_objects",
        TOLLGATE_TEST_RUN=run,
        TOLLGATE_LEAK_NETWORK=ours,
        TOLLGATE_LEAK_VOLUME=volume,
        TOLLGATE_LEAK_NEIGHBOUR=neighbour,
    )
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        assert "2 passed, 1 error" in result.stdout
        assert "the test session left behind" in result.stdout
        assert f"network {ours} (" in result.stdout and f"volume {volume}" in result.stdout
        assert neighbour not in result.stdout
    finally:
        remove_docker_objects(ours, volume, neighbour)


@pytest.mark.docker
def test_a_session_passes_while_a_neighbour_leaves_docker_objects() -> None:
    """Another process (another test run, an admin, another Tollgate on this Docker Engine)
    creates a container, a network and a volume during the session and leaves them: they are
    not the session's, so it passes."""
    neighbour = f"tollgate-neighbour-{uuid.uuid4().hex[:10]}"
    result = run_case("test_a_neighbour_leaves_docker_objects", TOLLGATE_LEAK_NEIGHBOUR=neighbour)
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout
        # They were there at the session's end, and are still.
        client = leaks.docker_client()
        assert client.containers.get(neighbour) and client.volumes.get(neighbour)
        assert [n.name for n in client.networks.list(names=[neighbour])] == [neighbour]
    finally:
        remove_docker_objects(neighbour)


def remove_docker_objects(*names: str) -> None:
    """The containers, networks and volumes of exactly these names, where they exist."""
    client = leaks.docker_client()
    for name in names:
        # Docker's name filters match parts of names too: remove only the exact ones.
        for container in client.containers.list(all=True, filters={"name": name}):
            if container.name == name:
                container.remove(force=True)
        for network in client.networks.list(names=[name]):
            if network.name == name:
                network.remove()
        for volume in client.volumes.list(filters={"name": name}):
            if volume.name == name:
                volume.remove(force=True)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
