"""The ``tollgate`` command line against a running Tollgate (Django's live server on the test
database): log in, create a tenant, a key and a price, export usage as CSV — each step run
as its own process, the way a script or CI job runs it."""

import csv
import io
import json
import os
import stat
import subprocess
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from metering import rollups
from metering.models import Price, UsageEvent
from tenants.models import ApiKey, Tenant
from tests.conftest import PASSWORD

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def cli(tmp_path: Path) -> Any:
    """Runs ``python -m tollgate_cli`` with a config file of its own (and no login in the env)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env |= {"TOLLGATE_CONFIG": str(tmp_path / "cfg" / "config.json"), "HOME": str(tmp_path)}

    def run(*args: str, stdin: str = "", extra_env: dict[str, str] | None = None) -> Any:
        return subprocess.run(
            [sys.executable, "-m", "tollgate_cli", *args],
            input=stdin,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**env, **(extra_env or {})},
            timeout=60,
        )

    run.config = tmp_path / "cfg" / "config.json"
    return run


def test_an_admin_sets_up_a_tenant_and_exports_its_usage(
    cli: Any, live_server: Any, root: Any, public_model: Any
) -> None:
    login = cli(
        "login", "--url", live_server.url, "--username", "root", "--password-stdin", stdin=PASSWORD
    )
    assert login.returncode == 0, login.stderr
    assert stat.S_IMODE(cli.config.stat().st_mode) == 0o600
    saved = json.loads(cli.config.read_text())
    assert saved["url"] == live_server.url and saved["token"].startswith("tga-")
    assert PASSWORD not in cli.config.read_text()

    made = cli("tenants", "create", "Acme Research", "--set", "requests_per_minute=120", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["slug"] == "acme-research"
    tenant = Tenant.objects.get(slug="acme-research")
    assert tenant.requests_per_minute == 120

    key = cli("keys", "create", "--tenant", "acme-research", "--name", "ci")
    assert key.returncode == 0, key.stderr
    plaintext = key.stdout.strip()
    assert plaintext.startswith("tg-") and "shown only now" in key.stderr
    issued = ApiKey.objects.get(tenant=tenant, name="ci")
    assert plaintext.split("-")[1] == issued.prefix
    # The key works on the gateway's own check of keys.
    auth = {"Authorization": f"Bearer {plaintext}"}
    assert httpx.get(f"{live_server.url}/v1/usage", headers=auth).status_code == 200

    price = cli("prices", "set", "--model", "qwen3-8b", "--input", "0.20", "--output", "0.60")
    assert price.returncode == 0, price.stderr
    current = Price.objects.filter(model=public_model).latest("effective_from")
    assert (current.input_per_mtok, current.output_per_mtok) == (Decimal("0.20"), Decimal("0.60"))

    event = UsageEvent.objects.create(
        request_id="req-cli-1",
        occurred_at=datetime.now(UTC),
        tenant=tenant,
        api_key=issued,
        model=public_model,
        prompt_tokens=1000,
        completion_tokens=500,
        cost=Decimal("0.000500"),
    )
    rollups.add_events([event.pk])  # what the usage consumer does after each batch
    out = cli.config.parent / "acme.csv"
    period = datetime.now(UTC).strftime("%Y-%m")
    export = cli("usage", "export", "--tenant", "acme-research", "--period", period, "-o", str(out))
    assert export.returncode == 0, export.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["tenant"] for r in rows] == ["acme-research"]
    assert int(rows[0]["prompt_tokens"]) == 1000 and int(rows[0]["completion_tokens"]) == 500
    assert rows[0]["key_prefix"] == issued.prefix

    listed = cli("tenants", "list")
    assert listed.returncode == 0 and "acme-research" in listed.stdout


def test_refusals_name_the_field_and_exit_1(
    cli: Any, live_server: Any, root: Any, client_for: Any
) -> None:
    from tenants import services

    token = services.issue_admin_token(root, name="env").plaintext
    env = {"TOLLGATE_URL": live_server.url, "TOLLGATE_TOKEN": token}
    refused = cli("tenants", "create", "Bravo", "--set", "priority_class=P0", extra_env=env)
    assert refused.returncode == 1
    assert "priority_class: Unknown field" in refused.stderr
    assert not Tenant.objects.filter(name="Bravo").exists()
    assert not cli.config.exists()  # the environment was enough


def test_a_wrong_password_or_token_is_refused_and_nothing_is_saved(
    cli: Any, live_server: Any, root: Any
) -> None:
    args = ("login", "--url", live_server.url, "--username", "root", "--password-stdin")
    wrong = cli(*args, stdin="not the password")
    assert wrong.returncode == 1 and "(401)" in wrong.stderr
    bad_token = cli("login", "--url", live_server.url, "--token", "tga-abcdefgh-" + "x" * 40)
    assert bad_token.returncode == 1
    assert not cli.config.exists()
    unreachable = cli("tenants", "list", "--url", "http://127.0.0.1:9", "--token", "x")
    assert unreachable.returncode == 2 and "cannot reach" in unreachable.stderr
