"""The image's entry point (compose/entrypoint.sh, installed as ``tollgate``) hands the
command line's subcommands to tollgate_cli, and ``usage`` alone stays the consumer role."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def entrypoint(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        ["bash", str(ROOT / "compose/entrypoint.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "usage_line"),
    [
        (("tenants", "create", "--help"), "usage: tollgate tenants create"),
        (("keys", "--help"), "usage: tollgate keys"),
        (("usage", "export", "--help"), "usage: tollgate usage export"),
        (("login", "--help"), "usage: tollgate login"),
    ],
)
def test_the_command_line_runs_through_the_image_entrypoint(
    args: tuple[str, ...], usage_line: str
) -> None:
    done = entrypoint(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage_line)


def test_usage_alone_is_still_the_consumer_role(tmp_path: Path) -> None:
    """``python3`` is a stand-in that prints what it was asked to run."""
    shim = tmp_path / "python3"
    shim.write_text('#!/bin/sh\necho "python3 $*"\n')
    shim.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "DJANGO_SECRET_KEY": "x" * 50,
        "DATABASE_URL": "postgres://nobody@127.0.0.1/none",
        "REDIS_URL": "redis://127.0.0.1:6379/0",  # given, so no secret file is awaited
    }
    runs = {
        args: subprocess.run(
            ["bash", str(ROOT / "compose/entrypoint.sh"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        ).stdout.strip()
        for args in [("usage",), ("usage", "export", "--tenant", "acme")]
    }
    assert runs[("usage",)] == "python3 manage.py consume_usage"
    assert runs[("usage", "export", "--tenant", "acme")] == (
        "python3 -m tollgate_cli usage export --tenant acme"
    )


def run_as(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``tollgate manage …`` in a service (the gateway unless ``TOLLGATE_IDENTITY`` says
    otherwise); ``python3`` is a stand-in that prints the database settings the real process
    would have read."""
    shim = tmp_path / "python3"
    shim.write_text(
        '#!/bin/sh\necho "DATABASE_URL=$DATABASE_URL"\necho "FILE=$DATABASE_URL_FILE"\n'
    )
    shim.chmod(0o755)
    base = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "TOLLGATE_IDENTITY": "gateway",
        "DJANGO_SECRET_KEY": "x" * 50,
        "REDIS_URL": "redis://127.0.0.1:6379/0",
    }
    return subprocess.run(
        ["bash", str(ROOT / "compose/entrypoint.sh"), "manage", "check"],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=30,
    )


def test_the_gateway_connects_as_its_own_role_when_the_owner_url_is_a_file(
    tmp_path: Path,
) -> None:
    """With both URLs from files (docs/operations/secrets.md), the owner's file must not
    win over the gateway role's URL (config/env.py prefers ``DATABASE_URL_FILE``)."""
    owner = tmp_path / "database_url"
    owner.write_text("postgres://tollgate:owner-secret@db.example.com/tollgate\n")
    gateway = tmp_path / "gateway_database_url"
    gateway.write_text("postgres://tollgate_gateway:gw-secret@db.example.com/tollgate\n")
    done = run_as(
        tmp_path,
        DATABASE_URL_FILE=str(owner),
        TOLLGATE_GATEWAY_DATABASE_URL_FILE=str(gateway),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "DATABASE_URL=postgres://tollgate_gateway:gw-secret@db.example.com/tollgate",
        "FILE=",
    ]
    # Without a gateway role of its own, it keeps the owner's file
    # (docs/operations/least-privilege.md).
    done = run_as(tmp_path, DATABASE_URL_FILE=str(owner))
    assert done.stdout.splitlines() == ["DATABASE_URL=", f"FILE={owner}"]


def test_an_unreadable_gateway_url_file_stops_the_gateway_with_its_name(tmp_path: Path) -> None:
    missing = tmp_path / "not-mounted"
    done = run_as(tmp_path, TOLLGATE_GATEWAY_DATABASE_URL_FILE=str(missing))
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"TOLLGATE_GATEWAY_DATABASE_URL_FILE='{missing}' cannot be read" in done.stderr
    assert "postgres://" not in done.stderr


@pytest.mark.parametrize("service", ["web", "worker", "batches", "usage"])
def test_web_worker_batches_and_usage_connect_as_the_application_role(
    tmp_path: Path, service: str
) -> None:
    """With the bundled database they use the application role keygen made a password for
    (rows, never the schema: config/dbroles.py), not the owner's (a superuser of the bundled
    database), which their secrets volumes do not hold; with TOLLGATE_APP_DATABASE_URL, that."""
    secrets_dir = tmp_path / "state" / "secrets"
    secrets_dir.mkdir(parents=True)
    (secrets_dir / "app_db_password").write_text("app-pw\n")
    done = run_as(tmp_path, TOLLGATE_IDENTITY=service, TOLLGATE_STATE_DIR=str(tmp_path / "state"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "DATABASE_URL=postgres://tollgate_app:app-pw@db:5432/tollgate",
        "FILE=",
    ]
    own = "postgres://app:own@db.example.com/tollgate"
    done = run_as(
        tmp_path,
        TOLLGATE_IDENTITY=service,
        DATABASE_URL="postgres://owner:secret@db.example.com/tollgate",
        TOLLGATE_APP_DATABASE_URL=own,
    )
    assert done.stdout.splitlines() == [f"DATABASE_URL={own}", "FILE="]
