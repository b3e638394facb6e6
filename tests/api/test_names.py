"""Objects are addressed by their human name (tenant slug, model served name, deployment,
node and user name; keys by id), bodies name related objects the same way, and the old
numeric ids of models, nodes and users still answer."""

from collections.abc import Callable
from decimal import Decimal
from urllib.parse import quote

import pytest
from rest_framework.test import APIClient

from deployments import services as deployment_services
from tests.api.conftest import World


def test_every_resource_answers_at_its_name(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    api = client_for(world.root)
    for url, key, value in [
        ("/api/v1/tenants/acme/", "slug", "acme"),
        ("/api/v1/models/qwen3-8b/", "served_name", "qwen3-8b"),
        ("/api/v1/deployments/qwen-main/", "name", "qwen-main"),
        (f"/api/v1/nodes/{world.node.name}/", "name", world.node.name),
        ("/api/v1/users/alice/", "username", "alice"),
        (f"/api/v1/keys/{world.alice_key.pk}/", "id", world.alice_key.pk),
    ]:
        answer = api.get(url)
        assert answer.status_code == 200 and answer.json()[key] == value, url


def test_a_served_name_with_a_slash_is_a_path_and_its_actions_still_match(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    deployment_services.create_model(
        None,
        served_name="Qwen/Qwen3-32B",
        source="Qwen/Qwen3-32B",
        params_billions=Decimal("32"),
        context_length=32768,
        visibility="private",
    )
    api = client_for(world.root)
    assert api.get("/api/v1/models/Qwen/Qwen3-32B/").json()["served_name"] == "Qwen/Qwen3-32B"
    granted = api.post("/api/v1/models/Qwen/Qwen3-32B/grant/", {"tenant": "acme"}, format="json")
    assert granted.status_code == 201 and granted.json()["granted_tenants"] == ["acme"]
    patched = api.patch("/api/v1/models/Qwen/Qwen3-32B/", {"description": "big"}, format="json")
    assert patched.status_code == 200 and patched.json()["description"] == "big"


def test_old_numeric_ids_still_answer_where_names_took_over(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    api = client_for(world.root)
    assert api.get(f"/api/v1/models/{world.public_model.pk}/").json()["served_name"] == "qwen3-8b"
    assert api.get(f"/api/v1/nodes/{world.node.pk}/").json()["name"] == world.node.name
    assert api.get(f"/api/v1/users/{world.alice.pk}/").json()["username"] == "alice"
    # …but never across the tenant line: carol's id lookup is as unknown as a bad name.
    carol = client_for(world.carol)
    hidden = carol.get(f"/api/v1/models/{world.private_model_a.pk}/")
    missing = carol.get("/api/v1/models/999999/")
    assert hidden.status_code == missing.status_code == 404


def test_bodies_name_related_objects_the_same_way(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    api = client_for(world.root)
    price = api.post(
        "/api/v1/prices/",
        {"model": "qwen3-8b", "input_per_mtok": "0.1", "output_per_mtok": "0.2"},
        format="json",
    )
    assert price.status_code == 201 and price.json()["model"] == "qwen3-8b"
    key = api.post(
        "/api/v1/keys/",
        {"tenant": "acme", "name": "ci", "allowed_models": ["qwen3-8b"]},
        format="json",
    )
    assert key.status_code == 201
    assert (key.json()["tenant"], key.json()["allowed_models"]) == ("acme", ["qwen3-8b"])
    by_id = api.post("/api/v1/prices/", {"model": world.public_model.pk}, format="json")
    assert by_id.status_code == 400


@pytest.mark.parametrize("name", ["³", "٣", "１", "3\n"])
def test_a_name_of_unicode_digits_is_an_unknown_name_not_a_server_error(
    world: World, client_for: Callable[..., APIClient], name: str
) -> None:
    """Python's ``isdigit`` holds for superscripts and other scripts' digits; ``int`` does not."""
    api = client_for(world.root)
    for resource in ("nodes", "models", "users"):
        answer = api.get(f"/api/v1/{resource}/{quote(name)}/")
        assert answer.status_code == 404, (resource, answer.content[:300])
        assert answer["Content-Type"].startswith("application/problem+json")
