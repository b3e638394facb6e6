"""bootstrap and seed_demo: first start needs no manual step and can run every start."""

import io
import re

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import call_command

from deployments.models import Deployment, Node
from metering.models import Price
from tenants.keys import verify_key
from tenants.models import ApiKey, Tenant

pytestmark = pytest.mark.django_db
User = get_user_model()


def run(command: str, *args: str) -> str:
    out = io.StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


def test_bootstrap_creates_the_admin_from_env_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_ADMIN_USERNAME", "ops")
    monkeypatch.setenv("TOLLGATE_ADMIN_PASSWORD", "a long and proper passphrase 7")
    first = run("bootstrap")
    second = run("bootstrap")
    assert "created platform admin 'ops'" in first and "one-time password" not in first
    assert "exists already" in second
    assert User.objects.filter(is_staff=True).count() == 1
    assert authenticate(username="ops", password="a long and proper passphrase 7") is not None
    assert Node.objects.count() == 1


def test_bootstrap_prints_a_one_time_password_that_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOLLGATE_ADMIN_PASSWORD", raising=False)
    output = run("bootstrap")
    password = re.search(r"one-time password for 'admin': (\S+)", output).group(1)
    assert authenticate(username="admin", password=password) is not None
    node = Node.objects.get()
    assert node.name == "local" and node.arch in {"amd64", "arm64"} and node.total_memory_bytes > 0


def test_seed_demo_builds_the_whole_flow_and_prints_a_working_key_once() -> None:
    run("bootstrap")
    output = run("seed_demo")
    plaintext = re.search(r"\(shown only now\): (tg-\S+)", output).group(1)
    key = ApiKey.objects.get(tenant__slug="demo")
    assert verify_key(plaintext, key.secret_hash)
    deployment = Deployment.objects.get(model__served_name="demo-chat")
    assert (
        deployment.image == "tollgate/engine-sim:latest" and deployment.desired_state == "running"
    )
    assert Price.objects.filter(model__served_name="demo-chat").count() == 1
    again = run("seed_demo")
    assert "tg-" not in again
    assert (Tenant.objects.count(), ApiKey.objects.count(), Deployment.objects.count()) == (1, 1, 1)


def test_issue_admin_token_prints_a_working_token_once(root: object) -> None:
    from rest_framework.test import APIClient

    token = run("issue_admin_token", "--user", "root", "--name", "ci").strip()
    assert token.startswith("tga-")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/v1/tenants/").status_code == 200
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="No active user"):
        run("issue_admin_token", "--user", "nobody")
