"""Tests that deliberately leave something behind, for test_leak_check.py to run in a pytest
session of their own. The file name does not match test_*.py, so normal runs never collect
it, and they skip unless TOLLGATE_LEAK_CASE is set.
"""

import os
import subprocess

import psycopg
import pytest
from django.db import connection

from tests import leaks

pytestmark = pytest.mark.skipif(
    not os.environ.get("TOLLGATE_LEAK_CASE"), reason="run by tests/suite/test_leak_check.py"
)
_kept: list[object] = []  # referenced for the whole session, so nothing closes them early


def test_leaves_a_child_process() -> None:
    proc = subprocess.Popen(["sleep", "600"])
    with open(os.environ["TOLLGATE_LEAK_PIDFILE"], "w") as f:
        f.write(str(proc.pid))
    _kept.append(proc)


@pytest.mark.django_db
def test_leaves_a_database_connection() -> None:
    db = connection.settings_dict
    conn = psycopg.connect(
        dbname=db["NAME"],
        user=db["USER"] or "postgres",
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        application_name="tollgate-leak-case",
    )
    _kept.append(conn)


@pytest.mark.django_db
def test_closes_what_it_opens() -> None:
    """The clean twin of the cases above: the same kinds of things, all closed again."""
    proc = subprocess.Popen(["sleep", "600"])
    proc.terminate()
    proc.wait()
    with psycopg.connect(
        dbname=connection.settings_dict["NAME"],
        user=connection.settings_dict["USER"] or "postgres",
        host=connection.settings_dict["HOST"] or "127.0.0.1",
        port=connection.settings_dict["PORT"] or 5432,
    ) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.docker
def test_leaves_docker_objects() -> None:
    """A network named with the run's token and a volume labelled with it."""
    client = leaks.docker_client()
    assert client is not None
    client.networks.create(os.environ["TOLLGATE_LEAK_NETWORK"])
    client.volumes.create(os.environ["TOLLGATE_LEAK_VOLUME"], labels={"tollgate.test": leaks.RUN})


@pytest.mark.docker
def test_a_neighbour_leaves_docker_objects() -> None:
    """What another process on the machine creates meanwhile: named and labelled like
    another Tollgate's, without this run's token."""
    client = leaks.docker_client()
    assert client is not None
    name = os.environ["TOLLGATE_LEAK_NEIGHBOUR"]
    labels = {"tollgate.managed": "true", "tollgate.stack": "tollgate"}
    client.networks.create(name, labels=labels)
    client.volumes.create(name, labels=labels)
    client.containers.create("tollgate/engine-sim:latest", name=name, labels=labels)
