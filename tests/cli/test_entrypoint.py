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
