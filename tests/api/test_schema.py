"""The OpenAPI schema is valid and describes every route the router serves; the docs page
works offline (its assets are served by Tollgate, not a CDN)."""

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.staticfiles import finders
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from config.api_urls import router
from tests.api.conftest import World

NAMED_GROUP = re.compile(r"\(\?P<(\w+)>[^)]*\)")


def router_operations() -> set[tuple[str, str]]:
    """(OpenAPI path, method) for every route and action the router serves."""
    operations = set()
    for pattern in router.urls:
        regex = pattern.pattern.regex.pattern
        if pattern.name == "api-root" or "(?P<format>" in regex:
            continue
        path = "/api/v1/" + NAMED_GROUP.sub(r"{\1}", regex).lstrip("^").rstrip("$")
        allowed = set(pattern.callback.cls.http_method_names) - {"head", "options"}
        operations |= {(path, method) for method in pattern.callback.actions if method in allowed}
    return operations


def _shape(path: str) -> str:
    return re.sub(r"\{\w+\}", "{}", path)


@pytest.fixture
def schema(world: World, client_for: Callable[..., APIClient]) -> dict[str, Any]:
    response = client_for(world.alice).get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/vnd.oai.openapi+json")
    return response.json()


def test_the_schema_is_valid_openapi(schema: dict[str, Any]) -> None:
    validate(schema)
    assert schema["info"]["title"] == "Tollgate admin API"


def test_every_route_and_action_of_the_router_is_in_the_schema(schema: dict[str, Any]) -> None:
    """Parameter names are compared as placeholders: drf-spectacular documents ``pk`` as
    ``id`` (SCHEMA_COERCE_PATH_PK), which is the same route."""
    expected = {(_shape(path), method) for path, method in router_operations()}
    assert len(expected) > 40  # the router was read, not an empty set compared to itself
    documented = {(_shape(path), method) for path, ops in schema["paths"].items() for method in ops}
    assert expected - documented == set()


def test_only_the_admin_token_and_session_authenticate(schema: dict[str, Any]) -> None:
    schemes = schema["components"]["securitySchemes"]
    assert schemes["adminToken"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "tga-<prefix>-<secret>",
        "description": "An admin API token created under /api/v1/tokens/.",
    }


def test_the_key_is_in_the_documented_create_response_only(schema: dict[str, Any]) -> None:
    create = schema["paths"]["/api/v1/keys/"]["post"]["responses"]["201"]
    ref = create["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "key" in schema["components"]["schemas"][ref]["properties"]
    detail = schema["paths"]["/api/v1/keys/{id}/"]["get"]["responses"]["200"]
    ref = detail["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "key" not in schema["components"]["schemas"][ref]["properties"]


def test_the_docs_page_renders_with_local_assets(
    world: World, client_for: Callable[..., APIClient]
) -> None:
    response = client_for(world.bob).get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "cdn.jsdelivr.net" not in html and "unpkg.com" not in html
    assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css|png))"', html)
    assert any("swagger-ui" in asset for asset in assets), html[:500]
    for asset in assets:
        assert asset.startswith("/static/"), asset
        assert finders.find(asset.removeprefix("/static/")), f"{asset} is not a local static file"
    assert "/api/schema/" in html


def test_list_shaped_actions_answer_what_the_schema_promises(
    schema: dict[str, Any], world: World, client_for: Callable[..., APIClient]
) -> None:
    """Schemathesis found ``/models/staged/`` answering a bare list where the schema
    promised a paginated object."""
    for path, url in [
        ("/api/v1/models/staged/", "/api/v1/models/staged/"),
        ("/api/v1/deployments/{name}/operations/", "/api/v1/deployments/qwen-main/operations/"),
    ]:
        ok = schema["paths"][path]["get"]["responses"]["200"]
        ref = ok["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert set(schema["components"]["schemas"][ref]["properties"]) == {
            "count",
            "next",
            "previous",
            "results",
        }
        body = client_for(world.root).get(url).json()
        assert set(body) == {"count", "next", "previous", "results"}, url
    operations = client_for(world.root).get("/api/v1/deployments/qwen-main/operations/").json()
    ids = [o["id"] for o in operations["results"]]
    assert world.operation.pk in ids and ids == sorted(ids, reverse=True)  # newest first


def test_blank_alternatives_are_any_of_not_an_ambiguous_one_of(schema: dict[str, Any]) -> None:
    """``""`` matches both the pattern and the blank branch of ``high_speed_interface``."""
    field = schema["components"]["schemas"]["Node"]["properties"]["high_speed_interface"]
    assert "oneOf" not in field and len(field["anyOf"]) == 2
    assert '"oneOf"' not in json.dumps(schema["components"]["schemas"])


def test_errors_are_declared_as_problems_and_bodies_refuse_unknown_fields(
    schema: dict[str, Any],
) -> None:
    create = schema["paths"]["/api/v1/tenants/"]["post"]
    for status in ("400", "401", "403", "404", "409"):
        content = create["responses"][status]["content"]
        assert content == {
            "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}
        }, status
    assert "429" in schema["paths"]["/api/v1/auth/token/"]["post"]["responses"]
    problem = schema["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail", "instance"}
    requests = {n: s for n, s in schema["components"]["schemas"].items() if n.endswith("Request")}
    assert len(requests) > 15
    assert all(s["additionalProperties"] is False for s in requests.values())
