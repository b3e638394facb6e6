"""The session-end check of tests/conftest.py fails a stage that leaves something behind.

Each case runs one test of leak_cases.py in a pytest session of its own (a subprocess, with
the repository's real conftest), then checks that session failed and named the leftover.
The leftover is then removed by this test: the process by its PID, the network by its name;
the check itself has already ended the database session.
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


def session(*args: str, **env: str) -> subprocess.CompletedProcess:
    """A pytest session of its own, on a test database of its own."""
    database = f"{os.environ.get('TOLLGATE_TEST_DATABASE') or 'test_tollgate'}_leak"
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


def run_case(name: str, **env: str) -> subprocess.CompletedProcess:
    return session(f"tests/suite/leak_cases.py::{name}", TOLLGATE_LEAK_CASE="1", **env)


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
def test_a_leftover_docker_network_fails_the_session(tmp_path: Path) -> None:
    name = f"tollgate-leak-{uuid.uuid4().hex[:10]}"
    result = run_case("test_leaves_a_docker_network", TOLLGATE_LEAK_NETWORK=name)
    client = leaks.docker_client()
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        assert "the test session left behind" in result.stdout
        assert f"network {name} (" in result.stdout
    finally:
        for network in client.networks.list(names=[name]):
            network.remove()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
