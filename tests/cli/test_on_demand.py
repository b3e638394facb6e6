"""``tollgate deployments`` with on-demand models, against a running Tollgate (Django's live
server on the test database), each step its own process: create one on demand with its
timeouts, see its mode and state in the list, change the timeouts and the mode, and have a
bad value refused naming the field."""

import json
from typing import Any

from deployments.models import Deployment
from tests.cli.test_adapters import login_env
from tests.cli.test_cli import cli, fast_password_hashing  # noqa: F401 - fixtures


def test_an_admin_makes_a_model_load_on_demand_from_the_shell(
    cli: Any, live_server: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    env = login_env(live_server, root)
    made = cli(
        "deployments", "create", "qwen-lazy", "--model", "qwen3-8b", "--node", "spark-1",
        "--image", "tollgate/engine-sim:latest", "--engine-arg", "max-num-seqs=4",
        "--mode", "on_demand", "--idle-timeout", "300", "--start-timeout", "120", "--json",
        extra_env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    answer = json.loads(made.stdout)
    assert (answer["mode"], answer["demand_state"]) == ("on_demand", "unloaded")
    deployment = Deployment.objects.get(name="qwen-lazy")
    assert (deployment.mode, deployment.idle_timeout_seconds) == ("on_demand", 300)
    assert deployment.start_timeout_seconds == 120

    listed = cli("deployments", "list", extra_env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[-2:] == ["MODE", "DEMAND_STATE"]
    assert row.split()[0] == "qwen-lazy" and row.split()[-2:] == ["on_demand", "unloaded"]

    changed = cli(
        "deployments", "update", "qwen-lazy", "--idle-timeout", "1800", "--start-timeout", "60",
        extra_env=env,
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    deployment.refresh_from_db()
    assert (deployment.idle_timeout_seconds, deployment.start_timeout_seconds) == (1800, 60)
    shown = json.loads(cli("deployments", "show", "qwen-lazy", extra_env=env).stdout)
    assert (shown["idle_timeout_seconds"], shown["start_timeout_seconds"]) == (1800, 60)

    always = cli("deployments", "update", "qwen-lazy", "--mode", "always", extra_env=env)
    assert always.returncode == 0, always.stderr
    assert Deployment.objects.get(name="qwen-lazy").mode == "always"
    row = cli("deployments", "list", extra_env=env).stdout.splitlines()[1]
    assert row.split()[-1] == "always"  # no demand state for an always-running one


def test_bad_values_are_refused_naming_the_field(
    cli: Any, live_server: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    env = login_env(live_server, root)
    create = (
        "deployments", "create", "qwen-lazy", "--model", "qwen3-8b", "--node", "spark-1",
        "--image", "tollgate/engine-sim:latest", "--engine-arg", "max-num-seqs=4",
        "--mode", "on_demand",
    )  # fmt: skip
    too_short = cli(*create, "--idle-timeout", "5", extra_env=env)
    assert too_short.returncode == 1
    assert "idle_timeout_seconds:" in too_short.stderr
    assert not Deployment.objects.exists()

    made = cli(*create, extra_env=env)
    assert made.returncode == 0, made.stderr
    too_long = cli("deployments", "update", "qwen-lazy", "--start-timeout", "90000", extra_env=env)
    assert too_long.returncode == 1 and "start_timeout_seconds:" in too_long.stderr
    assert Deployment.objects.get(name="qwen-lazy").start_timeout_seconds == 600

    # Refused by the command line itself: not a mode, not a number, nothing to change.
    for args in (("--mode", "sometimes"), ("--idle-timeout", "soon"), ()):
        misused = cli("deployments", "update", "qwen-lazy", *args, extra_env=env)
        assert misused.returncode == 2, (args, misused.stderr)
    assert Deployment.objects.get(name="qwen-lazy").mode == "on_demand"
