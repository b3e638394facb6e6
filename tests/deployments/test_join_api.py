"""Joining a node through the admin API: the token is shown once and works for that node only."""

import pytest

from deployments.joining import exchange_join_token
from deployments.models import JoinToken

pytestmark = pytest.mark.django_db


def test_a_join_token_is_shown_once_and_lets_that_node_join(
    client_for: object, root: object
) -> None:
    api = client_for(root)
    response = api.post(
        "/api/v1/nodes/join-token/",
        {"node_name": "spark-2", "control_plane": "10.0.0.1"},
        format="json",
    )
    assert response.status_code == 201
    body = response.json()
    assert body["token"].startswith("tgj-") and body["token"] in body["command"]
    assert "spark-2" in body["command"]
    row = JoinToken.objects.get()
    assert body["token"] not in row.secret_hash
    node = exchange_join_token(body["token"], "spark-2", engine_host="10.0.0.2").node
    assert node.name == "spark-2" and node.status == "online"


def test_bad_node_names_are_refused(client_for: object, root: object) -> None:
    response = client_for(root).post(
        "/api/v1/nodes/join-token/", {"node_name": "Bad Name!"}, format="json"
    )
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == ["node_name"]
