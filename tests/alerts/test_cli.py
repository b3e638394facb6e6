"""``tollgate webhooks``, ``notices`` and ``forecast`` against a running Tollgate, each step
its own process, as a script runs them."""

import json
from decimal import Decimal

from alerts import services
from alerts.choices import Event
from alerts.models import WebhookDelivery, WebhookEndpoint
from tenants import services as tenant_services
from tests.alerts.conftest import recipe
from tests.cli.test_cli import cli  # noqa: F401 - the fixture
from tests.conftest import PASSWORD


def test_an_admin_manages_webhooks_from_the_command_line(
    cli, live_server, alice, tenant_a, receiver
) -> None:
    login = cli(
        "login", "--url", live_server.url, "--username", "alice", "--password-stdin", stdin=PASSWORD
    )
    assert login.returncode == 0, login.stderr
    made = cli("webhooks", "create", receiver.url, "--tenant", "acme")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("whsec_") and "shown only now" in made.stderr
    endpoint = WebhookEndpoint.objects.get()
    assert endpoint.secret == secret and endpoint.events == ["budget.threshold"]

    refused = cli("webhooks", "create", "ftp://x.test/", "--tenant", "acme")
    assert refused.returncode == 1 and "http:// or https://" in refused.stderr
    platform = cli("webhooks", "create", "https://pager.test/", "--event", "engine.drift")
    assert platform.returncode == 1 and "platform admins" in platform.stderr

    listed = cli("webhooks", "list")
    assert receiver.url in listed.stdout and secret not in listed.stdout
    tested = cli("webhooks", "test", str(endpoint.pk))
    assert tested.returncode == 0 and "Test event queued" in tested.stdout
    (got,) = receiver.wait_for(1)
    recipe()["verify_tollgate_webhook"](secret, got.headers, got.body)
    log = cli("webhooks", "deliveries", "--status", "succeeded", "--json")
    assert [row["event"] for row in json.loads(log.stdout)] == ["test"]

    rotated = cli("webhooks", "rotate-secret", str(endpoint.pk))
    assert rotated.returncode == 0 and rotated.stdout.strip() != secret
    endpoint.refresh_from_db()
    assert endpoint.secret == rotated.stdout.strip()
    off = cli("webhooks", "update", str(endpoint.pk), "--set", "enabled=false")
    assert off.returncode == 0 and json.loads(off.stdout)["enabled"] is False
    assert WebhookDelivery.objects.count() == 1


def test_notices_and_forecasts_from_the_command_line(cli, live_server, alice, tenant_a) -> None:
    tenant_services.update_tenant(None, tenant_a, quota_amount=Decimal("100"))
    notice = services.raise_alert(
        Event.BUDGET_THRESHOLD, title="Acme at 50 %", detail="", payload={}, tenant=tenant_a
    )
    cli(
        "login", "--url", live_server.url, "--username", "alice", "--password-stdin", stdin=PASSWORD
    )
    listed = cli("notices", "list", "--open")
    assert "Acme at 50 %" in listed.stdout
    acked = cli("notices", "ack", str(notice.pk))
    assert acked.returncode == 0 and "Acknowledged: Acme at 50 %" in acked.stdout
    assert "Acme at 50 %" not in cli("notices", "list", "--open").stdout
    forecast = cli("forecast", "--tenant", "acme")
    assert forecast.returncode == 0, forecast.stderr
    assert "money: No usage in the last 24 h" in forecast.stdout
    assert cli("forecast", "--tenant", "bravo").returncode == 1
