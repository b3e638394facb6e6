"""The LoRA adapter pages with the Django test client: who sees and changes what, the form's
errors, the check, the replicas holding an adapter, its price, and the playground's list.

Users (tests/conftest.py): alice tenant A admin, bob tenant A member, carol tenant B admin,
root platform admin. Another tenant's private adapter answers 404 like one that does not
exist; a member's changes 403.
"""

import re
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from core.keyspace import lora_keys
from core.redis import get_redis
from deployments import adapters as adapter_services
from deployments import services as deployment_services
from deployments.choices import AdapterStatus, OperationKind, Visibility
from deployments.models import Adapter, AdapterGrant, CatalogModel, Deployment, Node, Replica
from metering import services as metering_services
from metering.models import UsageEvent
from tenants import services as tenant_services
from tenants.choices import Role
from tenants.models import AuditLog, Tenant

pytestmark = pytest.mark.django_db

# A tenant's adapters are named under its slug: the form's error for any other name.
ACME_SPACE = "Name Acme Research&#x27;s adapters acme/&lt;name&gt;, e.g. acme/support-v3."


def u(name: str, *args: object) -> str:
    return reverse(f"console:{name}", args=args)


def _adapter(
    tenant: Tenant | None,
    base: CatalogModel,
    name: str = "acme/support",
    status: str = AdapterStatus.READY,
    **fields: object,
) -> Adapter:
    """An adapter as the service makes it, then as its check left it (no worker here).
    Its files: acme/<name with - for />, e.g. acme/acme-support."""
    source = f"acme/{name.replace('/', '-')}"
    adapter = adapter_services.create_adapter(
        None, served_name=name, base=base, tenant=tenant, source=source, **fields
    )
    checked = {"rank": 16, "target_modules": ["q_proj", "v_proj"], "size_bytes": 18_400_000}
    Adapter.objects.filter(pk=adapter.pk).update(
        status=status, checked_at=timezone.now(), **(checked if status == "ready" else {})
    )
    adapter.refresh_from_db()
    return adapter


def _page(response: object) -> str:
    """The page without its CSRF token (masked afresh on every page)."""
    return re.sub(
        r'("X-CSRFToken": |name="csrfmiddlewaretoken" value=)"[^"]+"', "", response.content.decode()
    )


def _form(base: CatalogModel, **overrides: object) -> dict[str, object]:
    return {
        "served_name": "acme/support",
        "base": base.pk,
        "source": "acme/support-lora",
        "description": "Answers like our support desk.",
        **overrides,
    }


def _serving(model: CatalogModel, node: Node, name: str = "qwen-lora") -> Replica:
    """A deployment of ``model`` with adapters enabled and one ready replica."""
    deployment = Deployment.objects.create(
        name=name,
        model=model,
        node=node,
        image="tollgate/engine-sim:latest",
        engine_args={"enable-lora": True, "max-loras": 2},
        state="ready",
    )
    return Replica.objects.create(
        deployment=deployment, index=0, node=node, state="ready", host="127.0.0.1", port=8001
    )


def _hold(replica: Replica, adapter: Adapter) -> None:
    """What the worker records once it loaded the adapter into the replica's engine."""
    get_redis().hset(lora_keys(replica.pk)[0], adapter.pk, adapter.served_name)


# --- Adding, as a tenant admin -----------------------------------------------------------------


def test_tenant_admin_adds_an_adapter_for_their_tenant(
    web: object,
    alice: object,
    public_model: CatalogModel,
    private_model_a: CatalogModel,
    tenant_b: Tenant,
) -> None:
    bravo_only = CatalogModel.objects.create(
        served_name="bravo-secret",
        source="bravo/secret",
        params_billions=Decimal("7"),
        context_length=8192,
        visibility=Visibility.PRIVATE,
    )
    client = web(alice)
    form = client.get(u("adapter-new")).content.decode()
    # Her one tenant owns it; owner, visibility and grants are the platform admins' to set.
    assert 'name="tenant"' not in form and 'name="visibility"' not in form
    assert 'name="grants"' not in form
    assert "qwen3-8b" in form and "acme-secret-70b" in form and "bravo-secret" not in form

    response = client.post(u("adapter-new"), _form(public_model))
    adapter = Adapter.objects.get(served_name="acme/support")
    assert response.status_code == 302 and response["Location"] == u("adapter-detail", adapter.pk)
    assert adapter.tenant.slug == "acme" and adapter.visibility == Visibility.PRIVATE
    assert not adapter.pinned and adapter.status == AdapterStatus.CHECKING
    assert AuditLog.objects.filter(object_type="adapter", action="create").exists()

    page = client.get(response["Location"]).content.decode()
    assert "acme/support" in page and "Checking" in page and "Acme Research" in page
    # No deployment serves its base with adapters yet: the page says what it waits for.
    assert "Waiting for a deployment of qwen3-8b with adapters enabled" in page
    assert "acme/support-lora" in page and "Answers like our support desk." in page
    assert "unpriced: neither it nor its base has a price" in page
    # A base model it may not call is refused by the form, whatever the request says.
    refused = client.post(u("adapter-new"), _form(bravo_only, served_name="acme/sneaky"))
    assert refused.status_code == 400
    assert not Adapter.objects.filter(served_name="acme/sneaky").exists()
    assert "Select a valid choice" in refused.content.decode()


def test_an_admin_of_two_tenants_chooses_the_owner_among_their_models(
    web: object, alice: object, public_model: CatalogModel, private_model_a: CatalogModel
) -> None:
    labs = tenant_services.create_tenant(None, name="Acme Labs", slug="acme-labs")
    tenant_services.add_member(None, labs, alice, Role.ADMIN)
    client = web(alice)
    form = client.get(u("adapter-new")).content.decode()
    assert 'name="tenant"' in form and "Acme Labs" in form and "Bravo" not in form
    # Acme Labs may not call Acme's private model: said on the base field.
    refused = client.post(
        u("adapter-new"), _form(private_model_a, served_name="acme-labs/lora", tenant="acme-labs")
    )
    page = refused.content.decode()
    assert refused.status_code == 400 and "acme-labs may not call acme-secret-70b" in page
    ok = client.post(
        u("adapter-new"), _form(public_model, served_name="acme-labs/lora", tenant="acme-labs")
    )
    assert ok.status_code == 302
    assert Adapter.objects.get(served_name="acme-labs/lora").tenant == labs


def test_form_errors_keep_what_was_typed(
    web: object, alice: object, public_model: CatalogModel
) -> None:
    client = web(alice)
    outside = client.post(u("adapter-new"), _form(public_model, served_name="qwen3-8b"))
    page = outside.content.decode()
    assert outside.status_code == 400 and ACME_SPACE in page
    assert "acme/support-lora" in page and "Answers like our support desk." in page

    # The platform may name its own adapters anything, in Acme's space too.
    _adapter(None, public_model, name="acme/taken")
    again = client.post(u("adapter-new"), _form(public_model, served_name="acme/taken"))
    assert again.status_code == 400 and "already exists" in again.content.decode()
    model = deployment_services.create_model(
        None, served_name="acme/tuned", source="org/tuned", params_billions=1, context_length=4096
    )
    clash = client.post(u("adapter-new"), _form(public_model, served_name=model.served_name))
    assert clash.status_code == 400 and "A model is already called" in clash.content.decode()

    # Another tenant's adapter's files: not theirs to register under a name of their own.
    other = tenant_services.create_tenant(None, name="Other", slug="other")
    _adapter(other, public_model, name="other/lora")
    theirs = client.post(
        u("adapter-new"), _form(public_model, served_name="acme/mine", source="acme/other-lora")
    )
    assert theirs.status_code == 400 and "another adapter&#x27;s" in theirs.content.decode()

    bad = client.post(
        u("adapter-new"), _form(public_model, served_name="acme/bad name!", source="../etc")
    )
    page = bad.content.decode()
    assert bad.status_code == 400 and "Use letters, digits" in page
    assert "Give a Hugging Face repo id" in page
    assert Adapter.objects.filter(tenant__slug="acme").count() == 0


def test_a_name_outside_her_tenants_space_is_a_form_error_that_reveals_nothing(
    web: object, alice: object, tenant_a: Tenant, tenant_b: Tenant, public_model: CatalogModel
) -> None:
    """bravo/triage is tenant B's, bravo/nothing nobody's: tenant A's admin cannot tell."""
    _adapter(tenant_b, public_model, name="bravo/triage")
    own = _adapter(tenant_a, public_model)
    client = web(alice)
    pages = {}
    for name in ("bravo/triage", "bravo/nothing"):
        added = client.post(u("adapter-new"), _form(public_model, served_name=name))
        renamed = client.post(u("adapter-edit", own.pk), _form(public_model, served_name=name))
        for response in (added, renamed):
            assert response.status_code == 400
            [error] = response.context["form"].errors["served_name"]
            assert error == "Name Acme Research's adapters acme/<name>, e.g. acme/support-v3."
        pages[name] = [_page(r).replace(name, "<name>") for r in (added, renamed)]
    assert pages["bravo/triage"] == pages["bravo/nothing"]
    assert ACME_SPACE in pages["bravo/nothing"][0]
    assert sorted(Adapter.objects.values_list("served_name", flat=True)) == [
        "acme/support",
        "bravo/triage",
    ]


def test_only_a_platform_admin_keeps_an_adapter_loaded(
    web: object, alice: object, root: object, tenant_a: Tenant, public_model: CatalogModel
) -> None:
    """Pinned, it holds an engine slot on every replica of a base all tenants share: a tenant
    admin's form has no such choice, and a forged one pins nothing."""
    client = web(alice)
    assert "Keep it loaded" not in client.get(u("adapter-new")).content.decode()
    created = client.post(u("adapter-new"), _form(public_model, pinned="on"))
    assert created.status_code == 302
    adapter = Adapter.objects.get()
    assert not adapter.pinned
    edit = u("adapter-edit", adapter.pk)
    assert "Keep it loaded" in web(root).get(edit).content.decode()
    as_root = _form(public_model, pinned="on", tenant="acme", visibility=Visibility.PRIVATE)
    assert web(root).post(edit, as_root).status_code == 302
    adapter.refresh_from_db()
    assert adapter.pinned
    # Its tenant's admin may keep editing it: it stays pinned.
    kept = client.post(edit, _form(public_model, description="Kept."))
    assert kept.status_code == 302
    adapter.refresh_from_db()
    assert adapter.pinned and adapter.description == "Kept."


def test_a_form_without_csrf_token_is_refused(alice: object, public_model: CatalogModel) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    response = client.post(u("adapter-new"), _form(public_model))
    assert response.status_code == 403 and b"security token" in response.content
    assert not Adapter.objects.exists()


# --- Isolation and roles -----------------------------------------------------------------------


def test_another_tenants_private_adapter_is_like_a_missing_one(
    web: object, alice: object, carol: object, public_model: CatalogModel
) -> None:
    adapter = _adapter(Tenant.objects.get(slug="acme"), public_model)
    client = web(carol)
    assert "acme/support" not in client.get(u("adapter-list")).content.decode()
    missing = _page(client.get(u("adapter-detail", 999999)))
    for name in ("adapter-detail", "adapter-live", "adapter-edit", "adapter-delete"):
        response = client.get(u(name, adapter.pk))
        assert response.status_code == 404, name
        assert _page(response) == missing, name  # nothing tells them apart
    for name in ("adapter-check", "adapter-delete", "adapter-edit"):
        assert client.post(u(name, adapter.pk), _form(public_model)).status_code == 404, name
    assert Adapter.objects.filter(pk=adapter.pk, served_name="acme/support").exists()
    playground = client.get(u("playground") + "?tenant=bravo").content.decode()
    assert "acme/support" not in playground and "qwen3-8b" in playground
    # Alice, its tenant's admin, sees it and may change it.
    page = web(alice).get(u("adapter-detail", adapter.pk)).content.decode()
    assert u("adapter-edit", adapter.pk) in page and u("adapter-delete", adapter.pk) in page


def test_members_see_their_tenants_adapters_but_change_nothing(
    web: object, bob: object, public_model: CatalogModel
) -> None:
    adapter = _adapter(Tenant.objects.get(slug="acme"), public_model)
    client = web(bob)
    listing = client.get(u("adapter-list")).content.decode()
    assert "acme/support" in listing and u("adapter-new") not in listing
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "acme/support" in page and u("adapter-edit", adapter.pk) not in page
    assert "acme/acme-support" not in page  # the source is its admins' business
    assert 'id="adapter-usage"' not in page  # members read no usage reports
    assert client.get(u("adapter-new")).status_code == 403
    for name in ("adapter-edit", "adapter-delete", "adapter-check"):
        assert client.post(u(name, adapter.pk)).status_code == 403, name
    assert client.get(u("adapter-price", adapter.pk)).status_code == 403
    assert Adapter.objects.filter(pk=adapter.pk).exists()


def test_a_shared_adapter_is_usable_but_not_theirs_to_change(
    web: object, carol: object, tenant_a: Tenant, public_model: CatalogModel
) -> None:
    adapter = _adapter(tenant_a, public_model)
    adapter_services.grant_adapter(None, adapter, Tenant.objects.get(slug="bravo"))
    client = web(carol)
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "acme/support" in page and "Acme Research" not in page  # the owner stays unnamed
    assert "another tenant (shared with yours)" in page and "acme/acme-support" not in page
    assert client.get(u("adapter-edit", adapter.pk)).status_code == 403
    assert client.post(u("adapter-delete", adapter.pk)).status_code == 403
    assert "acme/support" in client.get(u("playground") + "?tenant=bravo").content.decode()


# --- Platform admins -------------------------------------------------------------------------


def test_platform_admin_sets_owner_visibility_grants_and_price(
    web: object, root: object, tenant_a: Tenant, tenant_b: Tenant, public_model: CatalogModel
) -> None:
    client = web(root)
    form = client.get(u("adapter-new")).content.decode()
    assert 'name="tenant"' in form and "None: the platform" in form and 'name="grants"' in form
    response = client.post(
        u("adapter-new"),
        _form(
            public_model,
            served_name="house-style",
            tenant="",
            visibility=Visibility.PRIVATE,
            grants=[tenant_a.pk, tenant_b.pk],
        ),
    )
    adapter = Adapter.objects.get(served_name="house-style")
    assert response.status_code == 302 and adapter.tenant is None
    assert set(adapter.granted_tenants.values_list("slug", flat=True)) == {"acme", "bravo"}

    edit = client.post(
        u("adapter-edit", adapter.pk),
        _form(
            public_model,
            served_name="acme/house-style",
            tenant="acme",
            visibility=Visibility.PRIVATE,
            grants=[tenant_b.pk],
        ),
    )
    assert edit.status_code == 302
    adapter.refresh_from_db()
    assert adapter.tenant == tenant_a and list(
        AdapterGrant.objects.values_list("tenant__slug", flat=True)
    ) == ["bravo"]
    assert AuditLog.objects.filter(action="ungrant", tenant=tenant_a).exists()

    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "Bravo Labs" in page and "Set a price" in page
    metering_services.set_price(None, public_model, Decimal("1"), Decimal("0.5"), Decimal("2"))
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "the base's price" in page and "2.00 USD / 1M tokens" in page
    priced = client.post(
        u("adapter-price", adapter.pk),
        {"currency": "usd", "input_per_mtok": "3", "output_per_mtok": "6"},
    )
    assert priced.status_code == 302
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "its own" in page and "6.00 USD / 1M tokens" in page
    listing = client.get(u("adapter-list") + "?tenant=acme").content.decode()
    assert "house-style" in listing and "Visibility" in listing
    assert "house-style" not in client.get(u("adapter-list") + "?tenant=bravo").content.decode()


def test_the_list_filters_by_base_model(
    web: object, root: object, public_model: CatalogModel, private_model_a: CatalogModel
) -> None:
    _adapter(None, public_model, name="on-qwen")
    _adapter(None, private_model_a, name="on-secret")
    client = web(root)
    by_base = client.get(u("adapter-list") + f"?base={private_model_a.pk}").content.decode()
    assert "on-secret" in by_base and "on-qwen" not in by_base
    # The model's page leads there; a model without adapters lists none.
    bare = deployment_services.create_model(
        None, served_name="bare", source="org/bare", params_billions=1, context_length=4096
    )
    link = f'href="/adapters/?base={bare.pk}"'
    assert link in client.get(u("model-detail", bare.pk)).content.decode()
    empty = client.get(u("adapter-list") + f"?base={bare.pk}").content.decode()
    assert "on-secret" not in empty and "on-qwen" not in empty
    everything = client.get(u("adapter-list")).content.decode()
    assert "on-secret" in everything and "on-qwen" in everything and "18.4 MB" in everything


# --- Its check, the replicas holding it, deletion ---------------------------------------------


def test_detail_shows_the_check_the_replicas_holding_it_and_the_usage_link(
    web: object, alice: object, root: object, public_model: CatalogModel, local_node: Node
) -> None:
    adapter = _adapter(Tenant.objects.get(slug="acme"), public_model)
    replica = _serving(public_model, local_node)
    client = web(alice)
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "Ready" in page and "18.4 MB" in page and "q_proj, v_proj" in page
    assert "No replica holds it now" in page
    assert 'href="/usage/?adapter=acme%2Fsupport"' in page
    assert "/playground/?model=acme%2Fsupport&amp;tenant=acme" in page

    _hold(replica, adapter)
    live = client.get(u("adapter-live", adapter.pk)).content.decode()
    assert f'data-replica="{replica.pk}"' in live and "qwen-lora" in live and "#0" in live
    # The deployment page says which adapters each replica holds, out of how many slots.
    admin = web(root)
    detail = admin.get(u("deployment-detail", "qwen-lora")).content.decode()
    assert "LoRA adapters" in detail and "acme/support" in detail and "1 of 2 slots" in detail
    assert "acme/support" in admin.get(u("deployment-progress", "qwen-lora")).content.decode()


def test_a_failed_check_is_shown_and_can_run_again(
    web: object, alice: object, public_model: CatalogModel, local_node: Node
) -> None:
    adapter = _adapter(Tenant.objects.get(slug="acme"), public_model, status=AdapterStatus.FAILED)
    Adapter.objects.filter(pk=adapter.pk).update(
        status_message="Only safetensors weights are accepted; found adapter_model.bin."
    )
    client = web(alice)
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "Failed its check" in page and "found adapter_model.bin" in page
    assert "Check again" in page
    _serving(public_model, local_node)
    response = client.post(u("adapter-check", adapter.pk))
    assert response.status_code == 302
    adapter.refresh_from_db()
    assert adapter.status == AdapterStatus.CHECKING and adapter.status_message == ""
    assert adapter.operations.filter(kind=OperationKind.CHECK_ADAPTER, status="queued").exists()
    page = client.get(u("adapter-detail", adapter.pk)).content.decode()
    assert "being checked again" in page and "queued for the worker of node spark-1" in page
    # Once more while that check waits: refused, said so.
    client.post(u("adapter-check", adapter.pk))
    assert (
        "is being checked already" in client.get(u("adapter-detail", adapter.pk)).content.decode()
    )
    assert adapter.operations.count() == 1


def test_delete_asks_first_and_is_refused_once_used(
    web: object, alice: object, public_model: CatalogModel
) -> None:
    acme = Tenant.objects.get(slug="acme")
    adapter = _adapter(acme, public_model)
    client = web(alice)
    confirm = client.get(u("adapter-delete", adapter.pk)).content.decode()
    assert "Delete" in confirm and "model not found" in confirm
    assert Adapter.objects.filter(pk=adapter.pk).exists()  # asking deletes nothing
    response = client.post(u("adapter-delete", adapter.pk))
    assert response.status_code == 302 and response["Location"] == u("adapter-list")
    assert not Adapter.objects.filter(pk=adapter.pk).exists()
    assert AuditLog.objects.filter(object_type="adapter", action="delete").exists()

    used = _adapter(acme, public_model, name="acme/used")
    UsageEvent.objects.create(
        request_id="req-1",
        occurred_at=timezone.now(),
        tenant=acme,
        model=public_model,
        adapter=used,
    )
    response = client.post(u("adapter-delete", used.pk), follow=True)
    assert "The adapter has usage" in response.content.decode()
    assert Adapter.objects.filter(pk=used.pk).exists()


# --- The playground --------------------------------------------------------------------------


def test_playground_lists_ready_adapters_under_their_base(
    web: object, alice: object, public_model: CatalogModel
) -> None:
    acme = Tenant.objects.get(slug="acme")
    _adapter(acme, public_model)
    _adapter(acme, public_model, name="acme/not-yet", status=AdapterStatus.CHECKING)
    page = web(alice).get(u("playground") + "?tenant=acme&model=acme/support").content.decode()
    group = page.split('<optgroup label="qwen3-8b and its adapters">')[1].split("</optgroup>")[0]
    assert 'value="qwen3-8b"' in group
    assert 'value="acme/support" data-adapter-of="qwen3-8b" selected' in group
    assert "not-yet" not in page  # its files are still being checked


def test_playground_prices_an_adapter_at_its_own_price_else_its_bases(
    alice: object, public_model: CatalogModel
) -> None:
    from console.views.playground import _priced  # noqa: PLC2701 - the price the page shows

    acme = Tenant.objects.get(slug="acme")
    adapter = _adapter(acme, public_model)
    base = metering_services.set_price(None, public_model, Decimal("1"), None, Decimal("2"))
    assert _priced(acme, "acme/support") == base
    own = metering_services.set_adapter_price(None, adapter, Decimal("3"), None, Decimal("6"))
    assert _priced(acme, "acme/support") == own and _priced(acme, "qwen3-8b") == base
    assert _priced(tenant_services.create_tenant(None, name="Other"), "acme/support") is None
