"""The playground asks which tenant to bill; staff tests go to Tollgate's own ``platform``
tenant, which customers' usage pages and showback exports leave out."""

import csv
import io
from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone

from deployments.models import CatalogModel
from metering.models import UsageRollup
from tenants import services
from tenants.models import Tenant
from tests.console.test_people import Web


def test_platform_admins_choose_the_tenant_and_may_bill_the_platform_tenant(
    web: Web, root: AbstractBaseUser, tenant_a: Tenant, public_model: CatalogModel
) -> None:
    client = web(root)
    page = client.get("/playground/").content.decode()
    assert 'id="pg-choose"' in page and 'id="pg-send"' not in page  # no silent default
    assert "Platform (staff tests)" in page and "Acme Research" in page
    page = client.get("/playground/?tenant=platform").content.decode()
    assert 'id="pg-send"' in page and "not in customers' showback" in page
    platform = Tenant.objects.get(slug="platform")
    assert platform.internal


def test_members_choose_among_their_own_tenants_only(
    web: Web, bob: AbstractBaseUser, tenant_b: Tenant, public_model: CatalogModel
) -> None:
    client = web(bob)
    page = client.get("/playground/").content.decode()
    assert 'id="pg-choose"' in page and "Platform (staff tests)" not in page
    refused = client.get("/playground/?tenant=bravo").content.decode()
    assert 'id="pg-send"' not in refused and "no active tenant “bravo”" in refused
    assert not Tenant.objects.filter(slug="platform").exists()


def test_no_customer_may_take_the_platform_slug(db: None) -> None:
    import pytest
    from django.core.exceptions import ValidationError

    assert services.create_tenant(None, name="Platform").slug == "platform-2"
    with pytest.raises(ValidationError):
        services.create_tenant(None, name="Sneaky", slug="platform")


def test_showback_leaves_the_platform_tenant_out_unless_named(
    web: Web, root: AbstractBaseUser, tenant_a: Tenant, public_model: CatalogModel
) -> None:
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for tenant, cost in ((tenant_a, "1.50"), (services.platform_tenant(), "9.00")):
        UsageRollup.objects.create(
            hour=hour, tenant=tenant, model=public_model, requests=1, cost=Decimal(cost)
        )
    client = web(root)

    def exported(query: str = "") -> list[dict]:
        answer = client.get(f"/usage/export.csv{query}")
        return list(csv.DictReader(io.StringIO(b"".join(answer.streaming_content).decode())))

    assert {r["tenant"] for r in exported()} == {"acme"}
    assert {r["tenant"] for r in exported("?tenant=platform")} == {"platform"}
    page = client.get("/usage/").content.decode()
    assert "Acme Research" in page and "Platform (staff tests)" not in page.split("<table")[-1]
