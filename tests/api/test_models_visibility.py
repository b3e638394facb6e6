"""Which catalogue models (and prices) each user sees, and what of them non-staff never see."""

from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from tests.api.conftest import World

# Who a private model is granted to, where it comes from and how it loads is platform business.
STAFF_ONLY_FIELDS = ["granted_tenants", "source", "revision", "trust_remote_code"]


def test_tenant_b_does_not_see_tenant_as_private_model_or_its_prices(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    carol = client_for(world.carol)
    names = [m["served_name"] for m in carol.get("/api/v1/models/").json()["results"]]
    assert "qwen3-8b" in names and "acme-secret-70b" not in names
    assert carol.get(f"/api/v1/models/{world.private_model_a.served_name}/").status_code == 404
    assert carol.get("/api/v1/models/", {"served_name": "acme-secret-70b"}).json()["count"] == 0

    prices = carol.get("/api/v1/prices/").json()["results"]
    assert [p["model"] for p in prices] == ["qwen3-8b"]
    assert carol.get(f"/api/v1/prices/{world.private_price_a.pk}/").status_code == 404


@pytest.mark.parametrize("who", ["alice", "bob"])
def test_tenant_a_users_see_their_private_model_and_its_price(
    who: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(getattr(world, who))
    names = [m["served_name"] for m in client.get("/api/v1/models/").json()["results"]]
    assert names == ["acme-secret-70b", "qwen3-8b"]
    detail = client.get(f"/api/v1/models/{world.private_model_a.served_name}/")
    assert detail.status_code == 200 and detail.json()["visibility"] == "private"
    price = client.get(f"/api/v1/prices/{world.private_price_a.pk}/").json()
    assert (price["model"], price["output_per_mtok"]) == ("acme-secret-70b", "3.000000")


@pytest.mark.parametrize("who", ["alice", "bob", "carol"])
def test_non_staff_never_see_grants_or_sources(
    who: str, world: World, client_for: Callable[..., APIClient]
) -> None:
    client = client_for(getattr(world, who))
    own_private = world.private_model_b if who == "carol" else world.private_model_a
    responses = [
        client.get("/api/v1/models/"),
        client.get(f"/api/v1/models/{own_private.served_name}/"),
        client.get(f"/api/v1/models/{world.public_model.served_name}/"),
    ]
    for response in responses:
        assert response.status_code == 200
        rows = response.json().get("results", [response.json()])
        assert rows
        for row in rows:
            assert set(STAFF_ONLY_FIELDS).isdisjoint(row), row
        for text in ("acme/secret-70b", "bravo/private-7b", "Qwen/Qwen3-8B"):
            assert text not in response.content.decode()


def test_platform_admins_see_grants_and_sources(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    """The fields above exist: a staff answer has them, so their absence means something."""
    model = (
        client_for(world.root).get(f"/api/v1/models/{world.private_model_a.served_name}/").json()
    )
    assert set(STAFF_ONLY_FIELDS) <= set(model)
    assert (model["granted_tenants"], model["source"]) == (["acme"], "acme/secret-70b")


def test_a_tenant_limited_to_listed_models_sees_only_those(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    root = client_for(world.root)
    response = root.patch(
        "/api/v1/tenants/bravo/",
        {"model_access": "listed", "allowed_models": ["bravo-private-7b"]},
        format="json",
    )
    assert response.status_code == 200
    names = [
        m["served_name"] for m in client_for(world.carol).get("/api/v1/models/").json()["results"]
    ]
    assert names == ["bravo-private-7b"]
    assert (
        client_for(world.carol).get(f"/api/v1/models/{world.public_model.served_name}/").status_code
        == 404
    )
