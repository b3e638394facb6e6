"""Every console page with the Django test client: roles, isolation, forms, CSRF, units.

Users (tests/conftest.py): alice tenant A admin, bob tenant A member, carol tenant B admin,
root platform admin. Another tenant's objects answer 404; members' admin actions 403.
"""

import csv
import io
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from deployments import joining
from deployments import services as deployment_services
from deployments.models import Deployment, EngineProfile, Node, Operation
from deployments.profiles import ensure_builtin_profiles
from metering import services as metering_services
from metering.models import UsageRollup
from tenants import services
from tenants.models import ApiKey, AuditLog, Tenant
from tests.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def u(name: str, *args: object) -> str:
    return reverse(f"console:{name}", args=args)


# --- Login, logout, password, throttling, CSRF ----------------------------------------------


def test_pages_need_a_login(tenant_a: Tenant) -> None:
    client = Client()
    for url in (
        u("home"),
        u("dashboard"),
        u("tenant-list"),
        u("tenant-detail", "acme"),
        u("usage"),
    ):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_login_with_the_right_password_then_logout(root: object) -> None:
    client = Client(enforce_csrf_checks=True)
    page = client.get(u("login"))
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    token = page.cookies["csrftoken"].value
    response = client.post(
        u("login"), {"username": "root", "password": PASSWORD, "csrfmiddlewaretoken": token}
    )
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get(u("dashboard")).status_code == 200
    assert client.get(u("logout")).status_code == 405  # a link cannot log anyone out
    token = client.cookies["csrftoken"].value
    assert client.post(u("logout"), {"csrfmiddlewaretoken": token}).status_code == 302
    assert client.get(u("dashboard")).status_code == 302


def test_repeated_wrong_passwords_lock_the_account_out(root: object, settings: object) -> None:
    client = Client(REMOTE_ADDR="10.9.8.7")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        response = client.post(u("login"), {"username": "root", "password": "wrong"})
        assert response.status_code == 200 and b"Please enter a correct" in response.content
    locked = client.post(u("login"), {"username": "root", "password": "wrong"})
    assert locked.status_code == 429 and b"Too many failed logins" in locked.content
    # Now even the right password is refused from this address…
    again = client.post(u("login"), {"username": "root", "password": PASSWORD})
    assert again.status_code == 429 and "_auth_user_id" not in client.session
    # …while the same user from elsewhere is not locked out.
    other = Client(REMOTE_ADDR="10.1.1.1")
    assert other.post(u("login"), {"username": "root", "password": PASSWORD}).status_code == 302


def test_a_form_without_csrf_token_is_refused(root: object) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(root)
    response = client.post(u("tenant-new"), {"name": "Sneaky"})
    assert response.status_code == 403 and b"security token" in response.content
    assert not Tenant.objects.filter(name="Sneaky").exists()
    assert (
        Client(enforce_csrf_checks=True)
        .post(u("login"), {"username": "root", "password": PASSWORD})
        .status_code
        == 403
    )


def test_password_change(web: object, alice: object) -> None:
    client = web(alice)
    bad = client.post(
        u("password-change"), {"old_password": "nope", "new_password1": "x", "new_password2": "x"}
    )
    assert bad.status_code == 200 and b"incorrectly" in bad.content
    ok = client.post(
        u("password-change"),
        {
            "old_password": PASSWORD,
            "new_password1": "a brand new passphrase 9",
            "new_password2": "a brand new passphrase 9",
        },
    )
    assert ok.status_code == 302
    alice.refresh_from_db()
    assert alice.check_password("a brand new passphrase 9")


# --- Home and navigation by role -------------------------------------------------------------


def test_home_sends_each_role_to_its_page(web: object, root: object, alice: object) -> None:
    assert web(root).get(u("home"))["Location"] == u("dashboard")
    assert web(alice).get(u("home"))["Location"] == u("tenant-detail", "acme")


def test_platform_pages_are_forbidden_to_tenant_users(
    web: object, alice: object, local_node: object
) -> None:
    client = web(alice)
    for url in (
        u("dashboard"),
        u("node-list"),
        u("deployment-list"),
        u("deployment-new"),
        u("tenant-new"),
        u("model-new"),
        u("node-detail", local_node.pk),
    ):
        response = client.get(url)
        assert response.status_code == 403, url
        assert b"Not allowed (403)" in response.content  # the console's own error page
    nav = client.get(u("tenant-detail", "acme")).content.decode()
    assert "Dashboard" not in nav and "Deployments" not in nav and "Playground" in nav


def test_unknown_page_is_the_consoles_404(web: object, root: object) -> None:
    response = web(root).get("/no/such/page/")
    assert response.status_code == 404 and b"Not found (404)" in response.content


# --- Dashboard --------------------------------------------------------------------------------


def test_dashboard_shows_nodes_deployments_and_live_rates(
    web: object, root: object, local_node: object, public_model: object
) -> None:
    Deployment.objects.create(
        name="d1",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        state="ready",
    )
    client = web(root)
    page = client.get(u("dashboard")).content.decode()
    assert "spark-1" in page and "Ready" in page and "1 deployment" in page
    assert "req/s" in page and "tokens/s" in page
    live = client.get(u("dashboard-live"))
    assert live.status_code == 200 and b"0.0 req/s" in live.content


# --- Tenants ---------------------------------------------------------------------------------


def test_platform_admin_creates_edits_and_suspends_a_tenant(web: object, root: object) -> None:
    client = web(root)
    response = client.post(
        u("tenant-new"),
        {
            "name": "Delta Corp",
            "priority": "P1",
            "requests_per_minute": "60",
            "tokens_per_minute": "",
            "max_concurrent_requests": "4",
            "quota_period": "monthly",
            "quota_tokens": "100000",
            "quota_amount": "25.00",
            "currency": "EUR",
            "model_access": "all",
        },
    )
    assert response.status_code == 302
    tenant = Tenant.objects.get(name="Delta Corp")
    assert (tenant.slug, tenant.requests_per_minute, tenant.tokens_per_minute) == (
        "delta-corp",
        60,
        None,
    )
    page = client.get(u("tenant-detail", "delta-corp")).content.decode()
    assert "100,000 tokens" in page and "25.00 EUR" in page and "60 req/min" in page
    client.post(
        u("tenant-edit", "delta-corp"),
        {
            "name": "Delta Corp",
            "slug": "delta-corp",
            "priority": "P0",
            "requests_per_minute": "30",
            "quota_period": "monthly",
            "currency": "EUR",
            "model_access": "all",
        },
    )
    tenant.refresh_from_db()
    assert tenant.priority == "P0" and tenant.requests_per_minute == 30
    assert AuditLog.objects.filter(
        object_type="tenant", action="update", changes__priority=["P1", "P0"]
    ).exists()
    client.post(u("tenant-status", "delta-corp") + "?status=suspended")
    tenant.refresh_from_db()
    assert tenant.status == "suspended"


def test_tenant_form_errors_keep_what_was_typed(web: object, root: object) -> None:
    response = web(root).post(
        u("tenant-new"),
        {
            "name": "Echo",
            "priority": "P1",
            "quota_period": "monthly",
            "currency": "eu1",
            "model_access": "all",
            "requests_per_minute": "-5",
            "quota_tokens": "123456",
        },
    )
    assert response.status_code == 400
    page = response.content.decode()
    assert "three-letter ISO 4217" in page and 'value="123456"' in page and 'value="Echo"' in page
    assert not Tenant.objects.filter(name="Echo").exists()


def test_tenant_list_is_scoped(web: object, alice: object, carol: object, root: object) -> None:
    assert "Bravo Labs" in web(root).get(u("tenant-list")).content.decode()
    mine = web(alice).get(u("tenant-list")).content.decode()
    assert "Acme Research" in mine and "Bravo Labs" not in mine


def test_tenant_b_sees_nothing_of_tenant_a(web: object, alice: object, carol: object) -> None:
    key = services.issue_api_key(alice, Tenant.objects.get(slug="acme"), name="a-key").key
    client = web(carol)
    for url in (u("tenant-detail", "acme"), u("key-detail", key.pk), u("key-edit", key.pk)):
        assert client.get(url).status_code == 404, url
    assert client.post(u("key-revoke", key.pk)).status_code == 404
    assert "a-key" not in client.get(u("key-list")).content.decode()
    assert client.get(u("usage-export") + "?tenant=acme").status_code == 404
    assert b"acme" not in b"".join(client.get(u("usage-export")).streaming_content)
    assert client.get(u("playground") + "?tenant=acme").status_code == 200
    assert (
        client.post(
            u("playground-chat"),
            '{"tenant": "acme", "model": "x", "messages": [{"role": "user", "content": "hi"}]}',
            content_type="application/json",
        ).status_code
        == 404
    )


def test_tenant_page_has_quota_models_prices_and_sdk_snippet(
    web: object, alice: object, public_model: object
) -> None:
    metering_services.set_price(None, public_model, Decimal("0.20"), None, Decimal("0.80"))
    page = web(alice).get(u("tenant-detail", "acme")).content.decode()
    assert (
        "qwen3-8b" in page and "0.200000 USD / 1M tokens" in page or "0.20 USD / 1M tokens" in page
    )
    assert 'base_url="http://testserver/v1"' in page and "No usage yet" in page


# --- API keys ----------------------------------------------------------------------------------


def test_tenant_admin_issues_a_key_shown_once_then_revokes_it(web: object, alice: object) -> None:
    client = web(alice)
    form = client.get(u("key-new") + "?tenant=acme")
    assert form.status_code == 200
    created = client.post(
        u("key-new"),
        {
            "tenant": Tenant.objects.get(slug="acme").pk,
            "name": "notebook",
            "requests_per_minute": "10",
        },
    )
    assert created.status_code == 200 and created["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(name="notebook")
    plaintext = created.context["plaintext"]
    assert plaintext.startswith(f"tg-{key.prefix}-") and plaintext in created.content.decode()
    detail = client.get(u("key-detail", key.pk)).content.decode()
    assert plaintext not in detail and key.masked in detail and "10 req/min" in detail
    client.post(u("key-revoke", key.pk))
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_key_limits_above_the_tenant_are_refused_on_the_form(web: object, alice: object) -> None:
    response = web(alice).post(
        u("key-new"),
        {
            "tenant": Tenant.objects.get(slug="acme").pk,
            "name": "greedy",
            "requests_per_minute": "999999",
        },
    )
    assert response.status_code == 400 and "exceed the tenant" in response.content.decode()
    assert 'value="greedy"' in response.content.decode()
    assert not ApiKey.objects.filter(name="greedy").exists()


def test_key_expiry_in_the_past_is_refused(web: object, alice: object) -> None:
    past = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    response = web(alice).post(
        u("key-new"),
        {"tenant": Tenant.objects.get(slug="acme").pk, "name": "old", "expires_at": past},
    )
    assert response.status_code == 400 and "must be in the future" in response.content.decode()


def test_members_see_their_own_keys_and_may_not_manage(
    web: object, alice: object, bob: object
) -> None:
    tenant = Tenant.objects.get(slug="acme")
    admins = services.issue_api_key(alice, tenant, name="alices-key").key
    bobs = services.issue_api_key(bob, tenant, name="bobs-key").key
    client = web(bob)
    listing = client.get(u("key-list")).content.decode()
    assert "bobs-key" in listing and "alices-key" not in listing
    assert client.get(u("key-detail", admins.pk)).status_code == 404
    assert client.get(u("key-detail", bobs.pk)).status_code == 200
    assert client.get(u("key-new")).status_code == 403
    assert client.post(u("key-new"), {"tenant": tenant.pk, "name": "x"}).status_code == 403
    assert client.post(u("key-revoke", bobs.pk)).status_code == 403
    assert client.get(u("key-edit", bobs.pk)).status_code == 403
    assert (
        client.get(u("usage")).status_code == 403 and client.get(u("audit-list")).status_code == 403
    )


def test_key_list_filters_sorts_and_paginates(web: object, root: object, tenant_a: Tenant) -> None:
    for i in range(30):
        services.issue_api_key(None, tenant_a, name=f"k{i:02d}")
    client = web(root)

    def names(page: str) -> set[str]:
        # Key prefixes are random text that can contain "k29": read the linked names only.
        return set(re.findall(r'<a href="/keys/\d+/">(k\d\d)</a>', page))

    first = client.get(u("key-list") + "?sort=name").content.decode()
    assert "k00" in names(first) and "k29" not in names(first) and "Page 1 of 2" in first
    second = client.get(u("key-list") + "?sort=name&page=2").content.decode()
    assert "k29" in names(second)
    assert names(client.get(u("key-list") + "?name=k07").content.decode()) == {"k07"}
    empty = client.get(u("key-list") + "?name=nothing-like-this").content.decode()
    assert "Nothing matches these filters" in empty


def test_key_list_state_filter_matches_the_status_column(
    web: object, root: object, tenant_a: Tenant
) -> None:
    """ "Active" leaves out keys that have expired, as the status column shows them."""
    services.issue_api_key(None, tenant_a, name="k-live")
    services.issue_api_key(
        None, tenant_a, name="k-old", expires_at=timezone.now() + timedelta(minutes=5)
    )
    gone = services.issue_api_key(None, tenant_a, name="k-gone")
    services.revoke_api_key(None, gone.key)
    client = web(root)

    def listed(state: str) -> set[str]:
        page = client.get(u("key-list") + f"?state={state}").content.decode()
        return set(re.findall(r'<a href="/keys/\d+/">(k-[a-z]+)</a>', page))

    assert listed("active") == {"k-live", "k-old"}
    with time_machine.travel(timezone.now() + timedelta(hours=1)):
        assert listed("active") == {"k-live"}
        assert listed("expired") == {"k-old"}
        assert listed("revoked") == {"k-gone"}


def test_empty_key_list_says_what_to_do(web: object, alice: object) -> None:
    page = web(alice).get(u("key-list")).content.decode()
    assert "No API keys yet" in page and "Issue a key" in page


# --- Models, prices, nodes ----------------------------------------------------------------------


def test_model_register_price_and_history(web: object, root: object) -> None:
    client = web(root)
    response = client.post(
        u("model-new"),
        {
            "served_name": "llama-3-8b",
            "source": "meta/llama-3-8b",
            "task": "generate",
            "params_billions": "8",
            "context_length": "8192",
            "visibility": "public",
            "quantization": "",
        },
    )
    assert response.status_code == 302
    from deployments.models import CatalogModel

    model = CatalogModel.objects.get(served_name="llama-3-8b")
    assert (
        client.post(
            u("price-new", model.pk),
            {"currency": "usd", "input_per_mtok": "0.1", "output_per_mtok": "0.4"},
        ).status_code
        == 302
    )
    backdated = client.post(
        u("price-new", model.pk),
        {
            "currency": "USD",
            "input_per_mtok": "1",
            "output_per_mtok": "1",
            "effective_from": "2020-01-01T00:00",
        },
    )
    assert backdated.status_code == 400 and "cannot be backdated" in backdated.content.decode()
    page = client.get(u("model-detail", model.pk)).content.decode()
    assert "0.40 USD / 1M tokens" in page and "Price history" in page
    listing = client.get(u("model-list")).content.decode()
    assert "llama-3-8b" in listing and "0.10 USD / 1M tokens" in listing


def test_a_rerank_model_is_registered_with_the_score_task(web: object, root: object) -> None:
    """Cross-encoders are their own kind: the gateway serves /v1/rerank and /v1/score on
    them only, and their engines run vLLM's pooling runner."""
    response = web(root).post(
        u("model-new"),
        {
            "served_name": "bge-reranker",
            "source": "BAAI/bge-reranker-v2-m3",
            "task": "score",
            "params_billions": "0.6",
            "context_length": "8192",
            "visibility": "public",
            "quantization": "",
        },
    )
    assert response.status_code == 302
    from deployments.models import CatalogModel

    assert CatalogModel.objects.get(served_name="bge-reranker").task == "score"
    listing = web(root).get(u("model-list"), {"task": "score"}).content.decode()
    assert "bge-reranker" in listing


def test_model_edit_refused_by_the_service_keeps_the_form(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    deployment_services.create_deployment(
        root,
        name="dep",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        engine_args=SMALL,
    )
    form = {
        "served_name": "renamed",
        "source": public_model.source,
        "task": "generate",
        "params_billions": "8.2",
        "context_length": "32768",
        "visibility": "public",
        "quantization": "",
    }
    response = web(root).post(u("model-edit", public_model.pk), form)
    page = response.content.decode()
    assert response.status_code == 400
    assert "Stop and remove its deployments before renaming." in page
    assert 'value="renamed"' in page  # what was typed is kept
    public_model.refresh_from_db()
    assert public_model.served_name == "qwen3-8b"


def test_granting_a_private_model_says_what_happened(
    web: object, root: object, private_model_a: object, tenant_b: Tenant
) -> None:
    client = web(root)
    granted = client.post(u("model-grant", private_model_a.pk), {"tenant": "bravo"}, follow=True)
    assert "Bravo Labs may now use acme-secret-70b." in granted.content.decode()
    again = client.post(u("model-grant", private_model_a.pk), {"tenant": "bravo"}, follow=True)
    assert "Bravo Labs already has acme-secret-70b." in again.content.decode()
    nobody = client.post(u("model-grant", private_model_a.pk), {"tenant": "nope"}, follow=True)
    assert "Choose a tenant to grant the model to." in nobody.content.decode()
    assert private_model_a.grants.filter(tenant=tenant_b).count() == 1


def test_tenants_see_only_their_models(
    web: object, carol: object, alice: object, private_model_a: object, public_model: object
) -> None:
    assert "acme-secret-70b" not in web(carol).get(u("model-list")).content.decode()
    assert web(carol).get(u("model-detail", private_model_a.pk)).status_code == 404
    assert "acme-secret-70b" in web(alice).get(u("model-list")).content.decode()


def test_node_register_and_detail(web: object, root: object) -> None:
    client = web(root)
    response = client.post(
        u("node-new"),
        {
            "name": "box-2",
            "docker_url": "tcp://10.0.0.2:2375",
            "arch": "arm64",
            "gpu_count": "1",
            "status": "online",
            "total_memory_gb": "128",
        },
    )
    assert response.status_code == 302
    page = client.get(response["Location"]).content.decode()
    assert "node.box-2" in page and "128.0 GB" in page
    assert "box-2" in client.get(u("node-list")).content.decode()


def test_join_token_is_shown_once_and_a_joined_name_is_refused(web: object, root: object) -> None:
    client = web(root)
    response = client.post(u("node-join"), {"node_name": "spark-2", "control_plane": "10.0.0.1"})
    page = response.content.decode()
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert "TOLLGATE_JOIN_TOKEN=tgj-" in page and "TOLLGATE_CONTROL_PLANE_URL=10.0.0.1" in page
    assert "SECRET_KEY" not in page and "DB_PASSWORD" not in page
    bad = client.post(u("node-join"), {"node_name": "Spark 2"})
    assert bad.status_code == 400 and "Lower-case letters, digits and -" in bad.content.decode()


def test_a_joined_node_is_revoked_from_its_page(web: object, root: object, alice: object) -> None:
    issued = joining.create_join_token(None, "spark-2")
    node = joining.exchange_join_token(issued.token, "spark-2", engine_host="10.0.0.2").node
    client = web(root)
    page = client.get(u("node-detail", node.pk)).content.decode()
    assert "Revoke credential" in page and "only this node's keys" in page
    assert web(alice).post(u("node-revoke", node.pk)).status_code in (302, 403, 404)
    assert Node.objects.get(pk=node.pk).status == "online"
    response = client.post(u("node-revoke", node.pk))
    assert response.status_code == 302
    page = client.get(response["Location"]).content.decode()
    assert "is revoked" in page and "Revoke credential" not in page
    assert Node.objects.get(pk=node.pk).status == "revoked"


# --- Deployments --------------------------------------------------------------------------------


SMALL = {"max-num-seqs": 4, "max-model-len": 4096}


def _deploy_form(model: object, node: object, **extra: str) -> dict[str, str]:
    return {
        "name": "qwen-main",
        "model": model.pk,
        "node": node.pk,
        "profile": "",
        "image": "tollgate/engine-sim:latest",
        "engine_args": "max-num-seqs=4\nmax-model-len=8k",
        "env": "",
        "replicas": "1",
        **extra,
    }


def test_deployment_with_bad_flags_is_refused_keeping_the_form(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    response = web(root).post(
        u("deployment-new"),
        _deploy_form(public_model, local_node, engine_args="port=9999\nmax-num-seqs=lots"),
    )
    page = response.content.decode()
    assert (
        response.status_code == 400
        and "--port cannot be set" in page
        and "--max-num-seqs expects" in page
    )
    assert "max-num-seqs=lots" in page and not Deployment.objects.exists()


def test_a_deployment_s_cpu_limit_is_a_form_field_and_shown_on_its_page(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    """The admin gives the engines' CPU cores (Docker's --cpus); too many for the node is a
    form error that keeps what was typed. Without a figure, the page says what the cpu
    profile leaves to Tollgate on this node."""
    local_node.cpu_count = 4
    local_node.save()
    client = web(root)
    too_many = client.post(u("deployment-new"), _deploy_form(public_model, local_node, cpus="6"))
    page = too_many.content.decode()
    assert too_many.status_code == 400 and "Node spark-1 has 4 CPU cores; give at most 4." in page
    assert 'value="6"' in page and not Deployment.objects.exists()

    assert (
        client.post(
            u("deployment-new"), _deploy_form(public_model, local_node, cpus="2.5")
        ).status_code
        == 302
    )
    assert Deployment.objects.get(name="qwen-main").cpus == Decimal("2.5")
    page = client.get(u("deployment-detail", "qwen-main")).content.decode()
    assert "2.5 cores per engine (--cpus)" in page

    ensure_builtin_profiles()
    cpu = EngineProfile.objects.get(name="cpu")
    form = _deploy_form(public_model, local_node, name="on-cpu", profile=cpu.pk, image="")
    assert client.post(u("deployment-new"), form).status_code == 302
    page = client.get(u("deployment-detail", "on-cpu")).content.decode()
    assert "3.5 of spark-1&#x27;s 4 cores per engine (profile cpu leaves 0.5 to Tollgate)" in page


def test_memory_fit_preview_before_submitting(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    client = web(root)
    ok = client.post(u("deployment-fit"), _deploy_form(public_model, local_node)).content.decode()
    assert "Fits." in ok and "GB" in ok
    too_big = client.post(
        u("deployment-fit"),
        _deploy_form(
            public_model,
            local_node,
            replicas="16",
            engine_args="max-num-seqs=256\nmax-model-len=32k",
        ),
    )
    assert "Does not fit." in too_big.content.decode()
    assert not Deployment.objects.exists()


def test_deployment_create_queues_a_deploy_and_shows_it(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    client = web(root)
    response = client.post(u("deployment-new"), _deploy_form(public_model, local_node))
    assert response.status_code == 302
    deployment = Deployment.objects.get(name="qwen-main")
    assert deployment.engine_args == {"max-num-seqs": 4, "max-model-len": 8192}
    assert Operation.objects.filter(deployment=deployment, kind="deploy").exists()
    page = client.get(u("deployment-detail", "qwen-main")).content.decode()
    assert "queued" in page.lower() and "--max-num-seqs 4" in page
    assert client.get(u("deployment-progress", "qwen-main")).status_code == 200
    assert "0 <span" in client.get(u("deployment-progress", "qwen-main")).content.decode()


def test_deployment_actions_call_the_services(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    deployment = deployment_services.create_deployment(
        root,
        name="dep",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        engine_args=SMALL,
    )
    client = web(root)
    client.post(u("deployment-action", "dep", "stop"))
    deployment.refresh_from_db()
    assert deployment.desired_state == "stopped"
    restart = client.post(u("deployment-action", "dep", "restart"), follow=True).content.decode()
    assert "Start the deployment instead" in restart
    client.post(u("deployment-action", "dep", "start"))
    client.post(u("deployment-scale", "dep"), {"replicas": "2"})
    deployment.refresh_from_db()
    assert deployment.desired_state == "running" and deployment.replicas == 2
    assert set(deployment.operations.values_list("kind", flat=True)) >= {"deploy", "stop", "scale"}
    assert client.get(u("deployment-logs", "dep") + "?replica=0").status_code == 200


def test_removing_a_deployment_goes_back_to_the_list(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    deployment_services.create_deployment(
        root,
        name="dep",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        engine_args=SMALL,
    )
    client = web(root)
    assert client.post(u("deployment-action", "dep", "explode")).status_code == 404
    response = client.post(u("deployment-action", "dep", "remove"))
    assert response.status_code == 302 and response["Location"] == u("deployment-list")
    listing = client.get(response["Location"]).content.decode()
    assert "dep is being drained, stopped and removed." in listing
    assert Operation.objects.filter(kind="remove").exists()


def test_deployment_progress_shows_phases(
    web: object, root: object, public_model: object, local_node: object
) -> None:
    deployment = deployment_services.create_deployment(
        root,
        name="dep",
        model=public_model,
        node=local_node,
        image="tollgate/engine-sim:latest",
        engine_args=SMALL,
    )
    Operation.objects.filter(deployment=deployment).update(
        status="running",
        phase="load",
        progress=45.0,
        detail={"replicas": {"0": {"phases": {"pull": 1.5, "create": 0.2, "start": 0.3}}}},
    )
    page = web(root).get(u("deployment-progress", "dep")).content.decode()
    assert 'class="done" data-phase="pull"' in page and 'class="current" data-phase="load"' in page
    assert "45 %" in page and "1.5 s" in page


# --- Usage, export, audit ---------------------------------------------------------------------


def _rollup(tenant: Tenant, model: object, tokens: int, cost: str, hours_ago: int = 1) -> None:
    hour = (timezone.now() - timedelta(hours=hours_ago)).replace(minute=0, second=0, microsecond=0)
    UsageRollup.objects.create(
        hour=hour,
        tenant=tenant,
        model=model,
        requests=2,
        prompt_tokens=tokens,
        completion_tokens=tokens,
        cost=Decimal(cost),
        currency="USD",
    )


def test_usage_page_charts_and_csv_totals_match(
    web: object, root: object, tenant_a: Tenant, tenant_b: Tenant, public_model: object
) -> None:
    _rollup(tenant_a, public_model, 1000, "0.5")
    _rollup(tenant_b, public_model, 500, "0.25")
    client = web(root)
    page = client.get(u("usage"))
    text = page.content.decode()
    assert page.status_code == 200 and "4 requests" in text and "1,500 tokens" in text
    assert page.context["totals"]["cost"] == Decimal("0.75") and "usage-chart" in text
    export = client.get(u("usage-export"))
    rows = list(csv.DictReader(io.StringIO(b"".join(export.streaming_content).decode())))
    assert sum(Decimal(r["cost"]) for r in rows) == Decimal("0.75")
    assert {r["tenant"] for r in rows} == {"acme", "bravo"}
    only_a = client.get(u("usage-export") + "?tenant=acme")
    assert {
        r["tenant"]
        for r in csv.DictReader(io.StringIO(b"".join(only_a.streaming_content).decode()))
    } == {"acme"}


def test_tenant_admin_usage_is_their_tenant_only(
    web: object, alice: object, tenant_b: Tenant, public_model: object
) -> None:
    _rollup(Tenant.objects.get(slug="acme"), public_model, 10, "0.01")
    _rollup(tenant_b, public_model, 999, "9")
    client = web(alice)
    page = client.get(u("usage"))
    assert page.context["totals"]["prompt_tokens"] == 10
    assert [r["tenant__slug"] for r in page.context["rows"]] == ["acme"]
    rows = list(
        csv.DictReader(
            io.StringIO(b"".join(client.get(u("usage-export")).streaming_content).decode())
        )
    )
    assert {r["tenant"] for r in rows} == {"acme"}


def test_tenant_page_shows_members_the_usage_of_their_own_keys(
    web: object, alice: object, bob: object, public_model: object
) -> None:
    tenant = Tenant.objects.get(slug="acme")
    alices = services.issue_api_key(alice, tenant, name="alice's").key
    bobs = services.issue_api_key(bob, tenant, name="bob's").key
    for key, tokens in ((alices, 100), (bobs, 7)):
        hour = timezone.now().replace(minute=0, second=0, microsecond=0)
        UsageRollup.objects.create(
            hour=hour,
            tenant=tenant,
            api_key=key,
            model=public_model,
            requests=1,
            prompt_tokens=tokens,
            completion_tokens=0,
            cost=Decimal("0"),
            currency="USD",
        )

    def tokens_charted(user: object) -> int:
        series = web(user).get(u("tenant-detail", "acme")).context["series"]
        return sum(sum(line["data"]) for line in series["tokens"])

    assert tokens_charted(alice) == 107 and tokens_charted(bob) == 7


def test_usage_with_no_data_explains(web: object, root: object) -> None:
    page = web(root).get(u("usage") + "?start=2020-01-01&end=2020-01-31").content.decode()
    assert "No usage in this period" in page


def test_audit_log_by_role(web: object, root: object, alice: object, carol: object) -> None:
    services.issue_api_key(alice, Tenant.objects.get(slug="acme"), name="audited")
    services.issue_api_key(carol, Tenant.objects.get(slug="bravo"), name="bravo-secret")
    assert "audited" in web(root).get(u("audit-list")).content.decode()
    alices = web(alice).get(u("audit-list")).content.decode()
    assert "audited" in alices and "bravo-secret" not in alices
    assert (
        "audited" in web(root).get(u("audit-list") + "?tenant=acme&action=create").content.decode()
    )


# --- Playground -----------------------------------------------------------------------------------


def test_playground_page_and_chat_validation(
    web: object, bob: object, public_model: object
) -> None:
    client = web(bob)
    page = client.get(u("playground") + "?tenant=acme").content.decode()
    assert "qwen3-8b" in page and "tg-" not in page
    bad = client.post(u("playground-chat"), "not json", content_type="application/json")
    assert bad.status_code == 400
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(bob)
    assert (
        strict.post(u("playground-chat"), "{}", content_type="application/json").status_code == 403
    )


def test_playground_key_is_issued_once_per_session_and_kept_server_side(
    web: object, bob: object
) -> None:
    from django.test import RequestFactory

    from console.views.playground import playground_key

    request = RequestFactory().post("/")
    request.user = bob
    request.session = web(bob).session
    tenant = Tenant.objects.get(slug="acme")
    first, fresh = playground_key(request, tenant)
    assert fresh and playground_key(request, tenant) == (first, False)
    key = ApiKey.objects.get(name="playground (bob)")
    assert key.created_by == bob and key.expires_at < timezone.now() + timedelta(hours=13)
    services.revoke_api_key(None, key)
    assert playground_key(request, tenant)[0] != first  # a revoked key is replaced


def test_units_on_numbers() -> None:
    from console.templatetags import console as fmt

    assert fmt.tokens(1234567) == "1,234,567 tokens" and fmt.gb(128 * 10**9) == "128.0 GB"
    assert (
        fmt.money(Decimal("0.000123"), "USD") == "0.000123 USD"
        and fmt.money(12, "EUR") == "12.00 EUR"
    )
    # One rule: at least two places, as many as the amount has, separators, no exponent.
    assert fmt.money(Decimal("9.00000E-5")) == "0.00009"
    assert fmt.money(Decimal("0.250000")) == "0.25" and fmt.money(Decimal("1.00")) == "1.00"
    assert fmt.money(Decimal("12345.5"), "USD") == "12,345.50 USD"
    assert fmt.money(Decimal("1E+3")) == "1,000.00" and fmt.money(Decimal("0E-9")) == "0.00"
    assert fmt.money(Decimal("0.000000001")) == "0.000000001" and fmt.money("x") == "—"
    assert (
        fmt.rate(2.5, "tokens") == "2.5 tokens/s"
        and fmt.pct(0.42) == "42 %"
        and fmt.ms(250) == "250 ms"
    )
    assert fmt.count(1, "request") == "1 request" and fmt.count(3, "request") == "3 requests"
    _ = datetime.now(UTC)
