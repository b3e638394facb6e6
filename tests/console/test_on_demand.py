"""On-demand deployments in the console, with the Django test client: the deployment form
sets the mode and its timeouts (bad values come back as form errors, as typed); the list
shows loaded / loading / unloaded and the last use; the detail page the settings, the
memory one replica takes and its node's budget; the node page its budget. Platform admins
only: alice, bob and carol get the console's 403 and change nothing.

``awake``, ``last_used_at`` and the replicas' states are the worker's to set; here they are
set by hand to show each state.
"""

import re
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from console.templatetags.console import gb
from deployments import demand, placement
from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from tenants.models import AuditLog

pytestmark = pytest.mark.django_db

SMALL = {"max-num-seqs": 4, "max-model-len": 4096}


def u(name: str, *args: object) -> str:
    return reverse(f"console:{name}", args=args)


def _form(model: Any, node: Any, **extra: str) -> dict[str, Any]:
    return {
        "name": "qwen-lazy",
        "model": model.pk,
        "node": node.pk,
        "profile": "",
        "image": "tollgate/engine-sim:latest",
        "engine_args": "max-num-seqs=4\nmax-model-len=4096",
        "env": "",
        "replicas": "1",
        "mode": "on_demand",
        "idle_timeout_seconds": "300",
        "start_timeout_seconds": "120",
        **extra,
    }


def _deploy(root: Any, model: Any, node: Any, name: str, **fields: Any) -> Deployment:
    return deployment_services.create_deployment(
        root,
        name=name,
        model=model,
        node=node,
        image="tollgate/engine-sim:latest",
        engine_args=SMALL,
        **fields,
    )


def _field(page: str, name: str) -> str:
    """The HTML of one form field's block (label, input, help, errors)."""
    match = re.search(rf'<div class="field[^"]*">\s*<label for="id_{name}">.*?</div>', page, re.S)
    assert match, f"no field {name}"
    return match.group(0)


def test_the_form_offers_the_mode_and_both_timeouts(
    web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    page = web(root).get(u("deployment-new")).content.decode()
    mode = _field(page, "mode")
    assert '<option value="always" selected>Always running</option>' in mode
    assert '<option value="on_demand">On demand</option>' in mode
    assert "not started until a request asks for it" in mode
    idle = _field(page, "idle_timeout_seconds")
    assert "Idle timeout (seconds)" in idle and 'value="900"' in idle and "15 min" in idle
    start = _field(page, "start_timeout_seconds")
    assert "Start timeout (seconds)" in start and 'value="600"' in start
    assert "503 with Retry-After" in start


def test_an_on_demand_deployment_is_created_from_the_form(
    web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    client = web(root)
    response = client.post(u("deployment-new"), _form(public_model, local_node))
    assert response.status_code == 302, response.content.decode()[:2000]
    deployment = Deployment.objects.get(name="qwen-lazy")
    assert (deployment.mode, deployment.idle_timeout_seconds) == ("on_demand", 300)
    assert deployment.start_timeout_seconds == 120 and not deployment.awake
    page = client.get(response["Location"]).content.decode()
    assert "On demand" in page and "300 s (5.0 min)" in page and "120 s (2.0 min)" in page
    assert '<div class="value" data-testid="demand-state"><span class="badge ">unloaded' in page
    assert "last use never" in page


def test_empty_fields_are_the_defaults(
    web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    form = _form(public_model, local_node, idle_timeout_seconds="", start_timeout_seconds="")
    assert web(root).post(u("deployment-new"), form).status_code == 302
    deployment = Deployment.objects.get(name="qwen-lazy")
    assert (deployment.idle_timeout_seconds, deployment.start_timeout_seconds) == (900, 600)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("idle_timeout_seconds", "5", "greater than or equal to 10"),
        ("idle_timeout_seconds", "90000", "less than or equal to 86400"),
        ("start_timeout_seconds", "soon", "Enter a whole number."),
        ("mode", "sometimes", "Select a valid choice."),
    ],
)
def test_bad_values_are_form_errors_and_what_was_typed_stays(
    field: str, value: str, error: str, web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    response = web(root).post(
        u("deployment-new"), _form(public_model, local_node, **{field: value})
    )
    assert response.status_code == 400
    page = response.content.decode()
    block = _field(page, field)
    assert 'class="field has-error' in block and error in block
    if field != "mode":
        assert f'value="{value}"' in block
    # Everything else is kept too.
    assert 'value="qwen-lazy"' in page and "max-model-len=4096" in page
    assert not Deployment.objects.exists()


def test_the_list_shows_each_models_state_and_last_use(
    web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    _deploy(root, public_model, local_node, "always-on")
    for name in ("lazy-loaded", "lazy-loading", "lazy-unloaded"):
        _deploy(root, public_model, local_node, name, mode="on_demand")
    used = timezone.now() - timedelta(minutes=5)
    Deployment.objects.filter(name__in=["lazy-loaded", "lazy-loading"]).update(
        awake=True, last_used_at=used
    )
    for name, state in (
        ("lazy-loaded", ReplicaState.READY),
        ("lazy-loading", ReplicaState.LOADING),
    ):
        Replica.objects.create(
            deployment=Deployment.objects.get(name=name), index=0, node=local_node, state=state
        )
    page = web(root).get(u("deployment-list")).content.decode()
    assert "<th" in page and "On demand" in page and "Last use" in page
    rows = {
        name: row
        for row in re.findall(r"<tr>.*?</tr>", page, re.S)
        for name in re.findall(r'href="/deployments/([\w-]+)/"', row)
    }
    assert '<span class="badge good">loaded</span>' in rows["lazy-loaded"]
    assert '<span class="badge warn">loading</span>' in rows["lazy-loading"]
    assert '<span class="badge ">unloaded</span>' in rows["lazy-unloaded"]
    assert "5\xa0minutes ago" in rows["lazy-loaded"] and "never" in rows["lazy-unloaded"]
    assert "loaded" not in rows["always-on"] and "ago" not in rows["always-on"]

    only = web(root).get(u("deployment-list") + "?mode=on_demand").content.decode()
    assert "lazy-unloaded" in only and "always-on" not in only


def test_the_detail_page_shows_memory_per_replica_and_the_nodes_budget(
    web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    _deploy(root, public_model, local_node, "always-on")
    lazy = _deploy(root, public_model, local_node, "lazy", mode="on_demand")
    Deployment.objects.filter(pk=lazy.pk).update(awake=True)
    budget = demand.node_budget(local_node)
    assert budget["always_bytes"] > 0 and budget["on_demand_bytes"] > 0  # both counted
    page = web(root).get(u("deployment-detail", "lazy")).content.decode()
    per_replica = gb(placement.rank_bytes(lazy, local_node))
    assert f"<dt>Memory per replica</dt><dd>{per_replica} on spark-1</dd>" in page
    assert "Does not fit" not in page and "Fits:" in page
    for label, key in (
        ("Usable by engines", "usable_bytes"),
        ("Always running", "always_bytes"),
        ("On demand, awake", "on_demand_bytes"),
        ("Free", "free_bytes"),
    ):
        shown = re.search(rf"<dt>{label}</dt><dd>(.*?)</dd>", page, re.S).group(1)
        assert gb(budget[key]) in shown and " GB" in shown, (label, shown)

    node_page = web(root).get(u("node-detail", local_node.pk)).content.decode()
    assert "Memory budget" in node_page
    for key in ("usable_bytes", "always_bytes", "on_demand_bytes", "free_bytes"):
        assert gb(budget[key]) in node_page


def test_the_detail_page_changes_the_mode_and_keeps_bad_values(
    web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    deployment = _deploy(root, public_model, local_node, "qwen-main")
    client = web(root)
    page = client.get(u("deployment-detail", "qwen-main")).content.decode()
    assert '<option value="always" selected>Always running</option>' in _field(page, "mode")
    url = u("deployment-action", "qwen-main", "demand")

    bad = {"mode": "on_demand", "idle_timeout_seconds": "5", "start_timeout_seconds": "60"}
    refused = client.post(url, bad)
    assert refused.status_code == 400
    page = refused.content.decode()
    assert "greater than or equal to 10" in _field(page, "idle_timeout_seconds")
    assert 'value="5"' in _field(page, "idle_timeout_seconds")
    assert '<option value="on_demand" selected>' in _field(page, "mode")
    assert 'value="60"' in _field(page, "start_timeout_seconds")
    deployment.refresh_from_db()
    assert (deployment.mode, deployment.start_timeout_seconds) == ("always", 600)

    done = client.post(url, {**bad, "idle_timeout_seconds": "1800"})
    assert done.status_code == 302 and done["Location"] == u("deployment-detail", "qwen-main")
    deployment.refresh_from_db()
    assert (deployment.mode, deployment.idle_timeout_seconds) == ("on_demand", 1800)
    assert deployment.start_timeout_seconds == 60
    entry = AuditLog.objects.filter(object_type="deployment", action="update").latest("id")
    assert entry.actor == root and entry.changes["mode"] == ["always", "on_demand"]
    page = client.get(done["Location"]).content.decode()
    assert "qwen-main: saved (on demand)." in page and "1800 s (30.0 min)" in page


@pytest.mark.parametrize("who", ["alice", "bob", "carol"])
def test_tenant_users_get_the_403_page_and_change_nothing(
    who: str, request: Any, web: Any, root: Any, public_model: Any, local_node: Any
) -> None:
    deployment = _deploy(root, public_model, local_node, "qwen-main")
    client = web(request.getfixturevalue(who))
    for response in (
        client.get(u("deployment-list") + "?mode=on_demand"),
        client.get(u("deployment-detail", "qwen-main")),
        client.get(u("node-detail", local_node.pk)),
        client.post(u("deployment-new"), _form(public_model, local_node)),
        client.post(
            u("deployment-action", "qwen-main", "demand"),
            {"mode": "on_demand", "idle_timeout_seconds": "60", "start_timeout_seconds": "60"},
        ),
    ):
        assert response.status_code == 403
        assert b"Not allowed (403)" in response.content and b"budget" not in response.content
    deployment.refresh_from_db()
    assert deployment.mode == "always" and Deployment.objects.count() == 1
