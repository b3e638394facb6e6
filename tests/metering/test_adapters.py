"""Metering per LoRA adapter: an adapter's usage is billed at its own price (its base's while it
has none), kept apart from its base's in rollups and exports, and seen only by its tenant."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import orjson
import pytest
import time_machine
from django.test import Client

from core.errors import Conflict
from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import FIELD, UsageRecord
from deployments.adapters import create_adapter, delete_adapter
from deployments.choices import AdapterStatus
from deployments.models import Adapter, CatalogModel
from metering import export, rollups, services
from metering.models import Price, UsageEvent, UsageRollup
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.metering.conftest import drain, emit, record

T0 = datetime(2026, 11, 10, 9, 0, tzinfo=UTC)
BASE_PRICE = (Decimal("1"), Decimal("0.5"), Decimal("2"))
LORA_PRICE = (Decimal("3"), Decimal("1.5"), Decimal("6"))
# 800 uncached + 200 cached prompt tokens and 300 completion tokens (conftest's record)
BASE_COST = Decimal("0.001500000")  # 800 x 1 + 200 x 0.5 + 300 x 2 per 1M
LORA_COST = Decimal("0.004500000")  # 800 x 3 + 200 x 1.5 + 300 x 6 per 1M


def make_adapter(model: CatalogModel, tenant: Tenant, name: str = "acme/support") -> Adapter:
    adapter = create_adapter(None, served_name=name, base=model, tenant=tenant, source="acme/lora")
    Adapter.objects.filter(pk=adapter.pk).update(status=AdapterStatus.READY)
    adapter.refresh_from_db()
    return adapter


@pytest.fixture
def adapter(tenant_a: Tenant, public_model: CatalogModel) -> Adapter:
    """Tenant A's private adapter on the public base model."""
    return make_adapter(public_model, tenant_a)


@pytest.fixture
def base_price(public_model: CatalogModel) -> Price:
    with time_machine.travel(T0 - timedelta(days=5), tick=False):
        return services.set_price(None, public_model, *BASE_PRICE)


@pytest.fixture
def lora_price(adapter: Adapter, base_price: Price) -> Price:
    with time_machine.travel(T0 - timedelta(days=5), tick=False):
        return services.set_adapter_price(None, adapter, *LORA_PRICE)


def ingest(*records: UsageRecord) -> None:
    emit(*records)
    drain()


def parse(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def export_rows(fmt: str = "showback", **params: str) -> list[dict[str, str]]:
    query = export.parse_query({"period": "2026-11", "granularity": "month", **params}, None)
    query = export.ExportQuery(**{**query.__dict__, "fmt": fmt})
    return parse("".join(export.csv_lines(query)))


# --- Pricing --------------------------------------------------------------------------------


def test_an_adapters_usage_is_billed_at_its_own_price(
    tenant_a, key_a, public_model, adapter, lora_price
) -> None:
    ingest(
        record(tenant_a, public_model, key_a, at=T0, request_id="base"),
        record(tenant_a, public_model, key_a, at=T0, request_id="lora", adapter_id=adapter.pk),
    )

    base, lora = (
        UsageEvent.objects.get(request_id="base"),
        UsageEvent.objects.get(request_id="lora"),
    )
    assert (base.adapter, base.cost) == (None, BASE_COST)
    assert (lora.adapter, lora.model, lora.price) == (adapter, public_model, lora_price)
    assert lora.cost == LORA_COST
    assert (lora.input_per_mtok, lora.output_per_mtok) == (Decimal("3"), Decimal("6"))


def test_an_adapter_without_a_price_is_billed_at_its_bases(
    tenant_a, key_a, public_model, adapter, base_price
) -> None:
    ingest(record(tenant_a, public_model, key_a, at=T0, adapter_id=adapter.pk))

    event = UsageEvent.objects.get()
    assert (event.adapter, event.price, event.cost) == (adapter, base_price, BASE_COST)


def test_the_adapter_price_applies_from_when_it_starts_and_the_base_before(
    tenant_a, key_a, public_model, adapter, base_price
) -> None:
    with time_machine.travel(T0, tick=False):
        own = services.set_adapter_price(None, adapter, *LORA_PRICE)
    assert services.price_at(public_model, "USD", T0 - timedelta(hours=1), adapter) == base_price
    assert services.price_at(public_model, "USD", T0 + timedelta(hours=1), adapter) == own
    # The base keeps its own price: an adapter's is never taken for it.
    assert services.price_at(public_model, "USD", T0 + timedelta(hours=1)) == base_price


def test_the_price_the_gateway_saw_stands_only_if_it_applies_to_the_adapter(
    tenant_a, key_a, public_model, adapter, base_price, lora_price
) -> None:
    """A gateway that priced an adapter's request at its base's (a stale cache, say) does not
    decide the bill; a base request never takes an adapter's price."""
    ingest(
        record(
            tenant_a,
            public_model,
            key_a,
            at=T0,
            request_id="lora-seen-base",
            adapter_id=adapter.pk,
            price_id=base_price.pk,
        ),
        record(
            tenant_a,
            public_model,
            key_a,
            at=T0,
            request_id="base-seen-lora",
            price_id=lora_price.pk,
        ),
    )

    assert UsageEvent.objects.get(request_id="lora-seen-base").cost == LORA_COST
    assert UsageEvent.objects.get(request_id="base-seen-lora").cost == BASE_COST


def test_repricing_the_adapter_does_not_rewrite_history(
    tenant_a, key_a, public_model, adapter, lora_price
) -> None:
    ingest(record(tenant_a, public_model, key_a, at=T0, request_id="before", adapter_id=adapter.pk))
    with time_machine.travel(T0 + timedelta(days=1), tick=False):
        services.set_adapter_price(None, adapter, Decimal("10"), None, Decimal("20"))
    later = T0 + timedelta(days=2)
    ingest(
        record(tenant_a, public_model, key_a, at=later, request_id="after", adapter_id=adapter.pk)
    )
    rollups.rebuild_rollups(T0 - timedelta(days=1), T0 + timedelta(days=3))

    assert UsageEvent.objects.get(request_id="before").cost == LORA_COST
    # 1000 x 10 + 300 x 20 per 1M (the cached input price defaults to the input price)
    assert UsageEvent.objects.get(request_id="after").cost == Decimal("0.016000000")
    lines = export_rows(adapter=adapter.served_name)
    assert sorted((r["input_per_mtok"], r["cost"]) for r in lines) == [
        ("10.000000", "0.016000000"),
        ("3.000000", "0.004500000"),
    ]


def test_base_and_adapter_prices_are_versioned_apart(public_model, adapter) -> None:
    at = datetime.now(UTC) + timedelta(days=1)
    services.set_price(None, public_model, *BASE_PRICE, effective_from=at)
    services.set_adapter_price(None, adapter, *LORA_PRICE, effective_from=at)  # same moment
    with pytest.raises(Conflict):
        services.set_adapter_price(None, adapter, *BASE_PRICE, effective_from=at)
    with pytest.raises(Conflict):
        services.set_price(None, public_model, *LORA_PRICE, effective_from=at)


def test_an_adapter_price_belongs_to_its_base(private_model_a, adapter) -> None:
    with pytest.raises(Exception, match="is an adapter of qwen3-8b"):
        services.set_price(None, private_model_a, *LORA_PRICE, adapter=adapter)


# --- Ingestion and rollups ------------------------------------------------------------------


def test_rollups_keep_base_and_adapter_apart_and_rebuild_the_same(
    tenant_a, key_a, public_model, adapter, lora_price
) -> None:
    ingest(
        *[record(tenant_a, public_model, key_a, at=T0) for _ in range(2)],
        *[record(tenant_a, public_model, key_a, at=T0, adapter_id=adapter.pk) for _ in range(3)],
    )

    def buckets() -> list[tuple]:
        rows = UsageRollup.objects.order_by("adapter_id")
        return [(r.model_id, r.adapter_id, r.requests, r.cost) for r in rows]

    expected = [
        (public_model.pk, adapter.pk, 3, 3 * LORA_COST),
        (public_model.pk, None, 2, 2 * BASE_COST),
    ]
    assert buckets() == expected
    rollups.rebuild_rollups(T0 - timedelta(hours=1), T0 + timedelta(hours=1))
    assert buckets() == expected


def test_records_from_before_adapters_still_decode_as_base_usage(
    tenant_a, key_a, public_model, base_price
) -> None:
    old = orjson.loads(record(tenant_a, public_model, key_a, at=T0).encode())
    del old["adapter_id"]  # what a gateway of the previous release wrote
    assert UsageRecord.decode(orjson.dumps(old)).adapter_id is None
    get_redis().xadd(usage_stream(), {FIELD: orjson.dumps(old)})
    drain()
    assert UsageEvent.objects.get().adapter is None


def test_usage_of_an_adapter_deleted_meanwhile_is_billed_as_its_base(
    tenant_a, key_a, public_model, base_price
) -> None:
    """An adapter without usage may be deleted while its first requests wait in the stream:
    they are still billed (at the base's price), never dropped."""
    gone = make_adapter(public_model, tenant_a, name="acme/short-lived")
    services.set_adapter_price(None, gone, *LORA_PRICE)
    pending = record(tenant_a, public_model, key_a, adapter_id=gone.pk)
    delete_adapter(None, gone)  # its price goes with it: nothing was billed at it
    ingest(pending)

    event = UsageEvent.objects.get()
    assert (event.adapter, event.price, event.cost) == (None, base_price, BASE_COST)


def test_an_adapter_with_usage_cannot_be_deleted(tenant_a, key_a, public_model, adapter) -> None:
    ingest(record(tenant_a, public_model, key_a, adapter_id=adapter.pk))
    with pytest.raises(Conflict):
        delete_adapter(None, adapter)
    assert Adapter.objects.filter(pk=adapter.pk).exists()


# --- Exports and pages ----------------------------------------------------------------------


@pytest.fixture
def usage(tenant_a, tenant_b, key_a, key_b, public_model, adapter, lora_price) -> None:
    """Tenant A: 2 base requests and 3 through its adapter; tenant B: 1 base request."""
    ingest(
        *[record(tenant_a, public_model, key_a, at=T0) for _ in range(2)],
        *[record(tenant_a, public_model, key_a, at=T0, adapter_id=adapter.pk) for _ in range(3)],
        record(tenant_b, public_model, key_b, at=T0),
    )


def test_showback_rows_carry_the_adapter_in_an_appended_column(usage, adapter) -> None:
    lines = export_rows(tenant="acme")

    assert export.SHOWBACK_COLUMNS[-1] == "adapter" and list(lines[0]) == export.SHOWBACK_COLUMNS
    assert sorted((r["model"], r["adapter"], r["requests"], r["cost"]) for r in lines) == [
        ("qwen3-8b", "", "2", "0.003000000"),
        ("qwen3-8b", "acme/support", "3", "0.013500000"),
    ]
    only = export_rows(adapter="acme/support")
    assert [(r["adapter"], r["requests"]) for r in only] == [("acme/support", "3")]
    # The base model's filter covers the usage of its adapters too.
    assert sum(int(r["requests"]) for r in export_rows(model="qwen3-8b")) == 6


def test_focus_rows_name_the_adapter_as_resource_and_sku(usage, adapter) -> None:
    rows = export_rows("focus", adapter="acme/support")

    assert {r["ResourceId"] for r in rows} == {"acme/support"}
    assert {r["ResourceType"] for r in rows} == {"LoRA adapter"}
    assert {r["SkuId"] for r in rows} == {
        "acme/support:input",
        "acme/support:cached-input",
        "acme/support:output",
    }
    assert "acme/support:output:6.000000" in {r["SkuPriceId"] for r in rows}
    assert "acme/support (adapter on qwen3-8b) output tokens" in {
        r["ChargeDescription"] for r in rows
    }
    assert sum(Decimal(r["BilledCost"]) for r in rows) == 3 * LORA_COST
    base = export_rows("focus", tenant="acme")
    assert {(r["ResourceId"], r["ResourceType"]) for r in base} == {
        ("qwen3-8b", "Model"),
        ("acme/support", "LoRA adapter"),
    }


def test_another_tenant_sees_none_of_it(usage, carol, client_for, key_b, lora_price) -> None:
    client = client_for(carol)
    lines = parse(
        b"".join(
            client.get("/api/v1/usage/export.csv", {"period": "2026-11"}).streaming_content
        ).decode()
    )
    assert {(r["tenant"], r["adapter"]) for r in lines} == {("bravo", "")}
    events = client.get("/api/v1/usage/", {"adapter__served_name": "acme/support"}).json()
    assert events["count"] == 0
    prices = client.get("/api/v1/prices/").json()["results"]
    assert all(p["adapter"] is None for p in prices)
    assert client.get(f"/api/v1/prices/{lora_price.pk}/").status_code == 404
    web = Client()
    web.force_login(carol)
    page = web.get("/usage/", {"group": "model", "start": "2026-11-01", "end": "2026-11-30"})
    assert page.status_code == 200 and "acme/support" not in page.content.decode()


def test_the_owner_sees_its_adapter_usage_and_price(usage, alice, client_for, lora_price) -> None:
    client = client_for(alice)
    events = client.get("/api/v1/usage/", {"adapter__served_name": "acme/support"}).json()
    assert events["count"] == 3
    assert {e["adapter"] for e in events["results"]} == {"acme/support"}
    price = client.get(f"/api/v1/prices/{lora_price.pk}/").json()
    assert (price["model"], price["adapter"], price["input_per_mtok"]) == (
        "qwen3-8b",
        "acme/support",
        "3.000000",
    )


def test_the_console_usage_page_has_a_row_per_model_and_adapter(usage, alice) -> None:
    web = Client()
    web.force_login(alice)
    page = web.get("/usage/", {"group": "model", "start": "2026-11-01", "end": "2026-11-30"})

    rows = [(r["model__served_name"], r["adapter__served_name"]) for r in page.context["rows"]]
    assert rows == [("qwen3-8b", None), ("qwen3-8b", "acme/support")]
    labels = {s["label"] for s in page.context["series"]["cost"]}
    assert labels == {"qwen3-8b", "acme/support (on qwen3-8b)"}
    filtered = web.get("/usage/", {"adapter": "acme/support", "start": "2026-11-01"})
    assert filtered.context["totals"]["requests"] == 3


def test_v1_usage_breaks_a_keys_usage_down_by_model_and_adapter(
    tenant_a, alice, public_model, adapter, lora_price
) -> None:
    issued = tenant_services.issue_api_key(alice, tenant_a, name="reader")
    ingest(
        *[record(tenant_a, public_model, issued.key, at=T0) for _ in range(2)],
        *[
            record(tenant_a, public_model, issued.key, at=T0, adapter_id=adapter.pk)
            for _ in range(3)
        ],
    )
    response = Client().get(
        "/v1/usage",
        {"group_by": "model", "start": "2026-11-01", "end": "2026-12-01"},
        HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}",
    )

    data = response.json()["data"]
    assert [(d["model"], d["adapter"], d["requests"]) for d in data] == [
        ("qwen3-8b", None, 2),
        ("qwen3-8b", "acme/support", 3),
    ]


# --- Setting prices through the admin API -----------------------------------------------------


def test_a_platform_admin_prices_an_adapter_through_the_admin_api(
    root, alice, client_for, adapter, base_price
) -> None:
    body = {"adapter": "acme/support", "input_per_mtok": "3", "output_per_mtok": "6"}
    assert client_for(alice).post("/api/v1/prices/", body, format="json").status_code == 403

    response = client_for(root).post("/api/v1/prices/", body, format="json")
    assert response.status_code == 201, response.content
    assert (response.json()["model"], response.json()["adapter"]) == ("qwen3-8b", "acme/support")
    now = datetime.now(UTC)
    assert services.price_at(adapter.base, "USD", now, adapter).input_per_mtok == Decimal("3")
    assert services.price_at(adapter.base, "USD", now) == base_price
    listed = client_for(root).get("/api/v1/prices/", {"adapter__isnull": "true"}).json()
    assert [p["id"] for p in listed["results"]] == [base_price.pk]
    neither = client_for(root).post("/api/v1/prices/", {"input_per_mtok": "1"}, format="json")
    assert neither.status_code == 400
