"""The command line's HTTP rules, without a server: loopback calls behind the TLS front, and
redirects reported instead of silently printing an empty answer."""

import httpx
import pytest

from tollgate_cli.client import Api, CliError, raise_for_problem


def test_loopback_calls_say_they_never_left_the_box_and_others_do_not() -> None:
    inside = Api("http://127.0.0.1:8000", "tga-x").client()
    assert inside.headers["X-Forwarded-Proto"] == "https"
    assert inside.headers["Authorization"] == "Bearer tga-x"
    for url in ("https://127.0.0.1:8443", "http://spark.example:8000"):
        assert "X-Forwarded-Proto" not in Api(url, "tga-x").client().headers


def test_a_redirect_is_an_error_naming_where_to() -> None:
    moved = httpx.Response(301, headers={"Location": "https://spark.example/api/v1/tenants/"})
    with pytest.raises(CliError, match="redirects to https://spark.example/api/v1/tenants/"):
        raise_for_problem(moved)


def test_a_problem_becomes_its_title_and_field_errors() -> None:
    body = {
        "type": "/api/problems/validation-error",
        "title": "The request has invalid fields.",
        "status": 400,
        "detail": "name: required",
        "instance": "/api/v1/tenants/",
        "errors": [{"field": "name", "message": "This field is required."}],
    }
    with pytest.raises(CliError) as refused:
        raise_for_problem(httpx.Response(400, json=body))
    assert str(refused.value) == (
        "The request has invalid fields. (400)\n  name: This field is required."
    )
