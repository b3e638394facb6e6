"""``tollgate adapters`` against a running Tollgate (Django's live server on the test database),
each step its own process: a platform admin and a tenant admin register, list, change, share,
check and delete LoRA adapters; refusals exit 1 with the API's reason (a tenant admin's
sharing or pinning, a name outside her tenant's space)."""

import json
from decimal import Decimal
from typing import Any

from deployments.choices import AdapterStatus
from deployments.models import Adapter
from metering.models import Price
from tenants import services
from tenants.models import AuditLog
from tests.cli.test_cli import cli, fast_password_hashing  # noqa: F401 - fixtures


def login_env(live_server: Any, user: Any) -> dict[str, str]:
    token = services.issue_admin_token(user, name="cli").plaintext
    return {"TOLLGATE_URL": live_server.url, "TOLLGATE_TOKEN": token}


def test_a_platform_admin_manages_adapters_from_the_shell(
    cli: Any, live_server: Any, root: Any, tenant_a: Any, tenant_b: Any, public_model: Any
) -> None:
    env = login_env(live_server, root)
    made = cli(
        "adapters",
        "create",
        "acme/support-v3",
        "--base",
        "qwen3-8b",
        "--source",
        "acme/support-v3-lora",
        "--tenant",
        "acme",
        "--description",
        "Support tone.",
        "--json",
        extra_env=env,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["tenant"] == "acme"
    adapter = Adapter.objects.get(served_name="acme/support-v3")
    assert (adapter.base, adapter.tenant, adapter.description) == (
        public_model,
        tenant_a,
        "Support tone.",
    )

    listed = cli("adapters", "list", "--tenant", "acme", extra_env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["SERVED_NAME", "BASE", "TENANT", "VISIBILITY", "STATUS", "RANK"]
    assert row.split() == ["acme/support-v3", "qwen3-8b", "acme", "private", "checking", "-"]
    assert cli("adapters", "list", "--tenant", "bravo", extra_env=env).stdout.count("\n") == 1

    shown = cli("adapters", "show", "acme/support-v3", extra_env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["source"] == "acme/support-v3-lora"
    updated = cli("adapters", "update", "acme/support-v3", "--set", "pinned=true", extra_env=env)
    assert updated.returncode == 0, updated.stderr
    assert Adapter.objects.get(pk=adapter.pk).pinned

    granted = cli("adapters", "grant", "acme/support-v3", "bravo", "--json", extra_env=env)
    assert granted.returncode == 0 and json.loads(granted.stdout)["granted_tenants"] == ["bravo"]
    revoked = cli("adapters", "revoke", "acme/support-v3", "bravo", "--json", extra_env=env)
    assert revoked.returncode == 0 and json.loads(revoked.stdout)["granted_tenants"] == []
    again = cli("adapters", "revoke", "acme/support-v3", "bravo", extra_env=env)
    assert again.returncode == 1 and "(404)" in again.stderr

    Adapter.objects.filter(pk=adapter.pk).update(status=AdapterStatus.FAILED)
    checked = cli("adapters", "check", "acme/support-v3", "--json", extra_env=env)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["status"] == "checking"

    priced = cli(
        "prices", "set", "--adapter", "acme/support-v3", "--input", "1", "--output", "2",
        extra_env=env,
    )  # fmt: skip
    assert priced.returncode == 0, priced.stderr
    price = Price.objects.get(adapter=adapter)
    assert (price.model, price.output_per_mtok) == (public_model, Decimal("2"))

    removed = cli("adapters", "delete", "acme/support-v3", extra_env=env)
    assert removed.returncode == 0 and "Removed acme/support-v3." in removed.stdout
    assert not Adapter.objects.filter(pk=adapter.pk).exists()
    actions = AuditLog.objects.filter(object_type="adapter", actor=root).values_list("action")
    assert {a for (a,) in actions} == {"create", "update", "grant", "ungrant", "action", "delete"}


def test_a_tenant_admin_registers_for_their_tenant_and_cannot_share(
    cli: Any, live_server: Any, alice: Any, carol: Any, public_model: Any
) -> None:
    env = login_env(live_server, alice)
    args = ("adapters", "create", "acme/legal", "--base", "qwen3-8b", "--source", "acme/legal")
    public = cli(*args, "--set", "visibility=public", extra_env=env)
    assert public.returncode == 1
    assert "(403)" in public.stderr and "Only platform admins share an adapter" in public.stderr
    assert not Adapter.objects.exists()

    made = cli(*args, "--json", extra_env=env)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["tenant"] == "acme"
    grant = cli("adapters", "grant", "acme/legal", "bravo", extra_env=env)
    assert grant.returncode == 1 and "(403)" in grant.stderr
    pin = cli("adapters", "update", "acme/legal", "--set", "pinned=true", extra_env=env)
    assert pin.returncode == 1 and "(403)" in pin.stderr
    assert "Only platform admins pin an adapter" in pin.stderr
    assert not Adapter.objects.get(served_name="acme/legal").pinned

    # Tenant B's admin finds nothing of it.
    carol_env = login_env(live_server, carol)
    hidden = cli("adapters", "show", "acme/legal", extra_env=carol_env)
    assert hidden.returncode == 1 and "(404)" in hidden.stderr
    assert "acme/legal" not in cli("adapters", "list", extra_env=carol_env).stdout
    # Nor by naming one in its space: taken or not, the name is refused as not hers.
    for name in ("acme/legal", "acme/other"):
        clash = cli(
            "adapters", "create", name, "--base", "qwen3-8b", "--source", "bravo/x",
            extra_env=carol_env,
        )  # fmt: skip
        assert clash.returncode == 1 and "(400)" in clash.stderr
        space = "served_name: Name Bravo Labs's adapters bravo/<name>, e.g. bravo/support-v3."
        assert space in clash.stderr and "exists" not in clash.stderr
