"""Deployments: list, create (with a memory-fit preview), actions, live progress, logs,
replica health and engine metrics, on-demand settings and the node's memory budget.
Platform admins only."""

from typing import Any

import django_filters
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from console import queries
from console.access import staff_required
from console.forms import DemandForm, DeploymentForm, ScaleForm, parse_flags
from console.generic import Action, Column, ListPage, saved, service_action, service_form
from console.templatetags.console import ago, badge
from deployments import demand, placement, services
from deployments.adapter_loading import loaded
from deployments.choices import DeploymentMode, DeploymentState, DesiredState, OperationStatus
from deployments.models import CatalogModel, Deployment, EngineProfile, Node, Operation
from metering import bill_check

# The start sequence of one replica, as deployments.engine.Starter reports it.
PHASES = [
    ("pull", "Pull image"),
    ("create", "Create"),
    ("start", "Start"),
    ("load", "Load weights"),
    ("models", "Serve model"),
    ("warmup", "Warm up"),
]
# An on-demand deployment's state (deployments.demand.demand_state) -> the badge's colour.
DEMAND_BADGES = {"loaded": "ready", "loading": "loading", "unloaded": "stopped"}


class DeploymentFilter(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains", label="Name")
    state = django_filters.ChoiceFilter(choices=DeploymentState.choices, empty_label="Any state")
    node = django_filters.ModelChoiceFilter(queryset=Node.objects.all(), empty_label="Any node")
    mode = django_filters.ChoiceFilter(choices=DeploymentMode.choices, empty_label="Any mode")

    class Meta:
        model = Deployment
        fields = ["name", "state", "node", "mode"]


def demand_badge(deployment: Deployment) -> str:
    """loaded / loading / unloaded for an on-demand deployment; "" for an always-running one."""
    state = demand.demand_state(deployment)
    return badge(DEMAND_BADGES[state], state) if state else ""


@staff_required
def deployment_list(request: HttpRequest) -> HttpResponse:
    detail = lambda d: reverse("console:deployment-detail", args=[d.name])  # noqa: E731
    new = reverse("console:deployment-new")
    page = ListPage(
        title="Deployments",
        nav="deployments",
        queryset=Deployment.objects.select_related("model", "node"),
        filterset_class=DeploymentFilter,
        default_sort="name",
        columns=[
            Column("Name", lambda d: d.name, sort="name", href=detail),
            Column("Model", lambda d: d.model.served_name, sort="model__served_name"),
            Column(
                "Node",
                lambda d: d.node.name if d.node else ("external" if d.external else "any"),
                sort="node__name",
            ),
            Column("State", lambda d: badge(d.state, d.get_state_display()), sort="state"),
            Column("Desired", lambda d: d.get_desired_state_display(), sort="desired_state"),
            Column("On demand", demand_badge, sort="mode"),
            Column(
                "Last use",
                lambda d: ago(d.last_used_at) if d.on_demand else "",
                sort="last_used_at",
            ),
            Column(
                "Replicas",
                lambda d: f"{d.replicas} engine{'s' if d.replicas != 1 else ''}",
                sort="replicas",
                numeric=True,
            ),
            Column("Image", lambda d: d.image),
        ],
        actions=[Action("New deployment", new, style="primary")],
        empty_title="Nothing deployed yet",
        empty_hint="Deploy a registered model on a node; the simulator profile needs no GPU.",
        empty_action=Action("Deploy a model", new, style="primary"),
    )
    return page.render(request)


@staff_required
def deployment_new(request: HttpRequest) -> HttpResponse:
    initial: dict[str, Any] = {
        "profile": EngineProfile.objects.filter(name="dgx-spark").first(),
        "node": Node.objects.order_by("name").first(),
    }
    if (wanted := request.GET.get("model", "")).isascii() and wanted.isdigit():
        initial["model"] = CatalogModel.objects.filter(pk=request.GET["model"]).first()
        if initial["model"]:
            initial["name"] = (
                initial["model"].served_name.replace("/", "-").replace(".", "-").lower()[:60]
            )
    form = DeploymentForm(request.POST or None, initial=initial)
    return service_form(
        request,
        form,
        lambda f: services.create_deployment(request.user, **f.service_data()),
        lambda deployment: saved(
            request,
            f"{deployment} is queued: follow its progress below.",
            "console:deployment-detail",
            name=deployment.name,
        ),
        "New deployment",
        cancel=reverse("console:deployment-list"),
        submit="Deploy",
        nav="deployments",
        template="console/deployments/form.html",
        extra=lambda: {
            "fit": _fit(form) if form.is_bound else None,
            "profiles": EngineProfile.objects.all(),
        },
    )


def _fit(form: DeploymentForm) -> dict[str, Any]:
    """The memory-fit verdict for the form's current values, as the service computes it."""
    data = (
        {k: form.cleaned_data.get(k) for k in ("model", "node", "profile", "replicas", "mode")}
        if hasattr(form, "cleaned_data")
        else {}
    )
    if not data.get("model"):
        return {"message": "Choose a model to see whether it fits.", "fits": None}
    try:
        # The raw text: flags that do not parse are missing from cleaned_data; say why here.
        flags = parse_flags(form.data.get("engine_args", ""))
        verdict = services.preview_fit(
            data["model"],
            data.get("node"),
            data.get("profile"),
            data.get("replicas") or 1,
            flags,
            mode=data.get("mode") or DeploymentMode.ALWAYS,
        )
    except ValidationError as exc:
        return {"message": " ".join(exc.messages), "fits": False}
    if verdict is None:
        return {"message": "No node chosen: Tollgate places it where memory is free.", "fits": None}
    return {"message": verdict.message, "fits": verdict.fits}


@staff_required
@require_POST
def deployment_fit(request: HttpRequest) -> HttpResponse:
    """htmx: the memory-fit preview while the admin fills the form (nothing is saved)."""
    form = DeploymentForm(request.POST)
    form.is_valid()
    return render(request, "console/deployments/_fit.html", {"fit": _fit(form)})


def _deployment(name: str) -> Deployment:
    return get_object_or_404(
        Deployment.objects.select_related("model", "node", "profile"), name=name
    )


@staff_required
def deployment_detail(request: HttpRequest, name: str) -> HttpResponse:
    deployment = _deployment(name)
    form = DemandForm(initial=_demand_initial(deployment))
    return render(
        request,
        "console/deployments/detail.html",
        {"nav": "deployments", **_detail_page(deployment, form)},
    )


def _detail_page(deployment: Deployment, demand_form: DemandForm) -> dict[str, Any]:
    """The detail page: live state, settings and actions, memory and the node's budget."""
    node = deployment.node or _replica_node(deployment)
    fit = services.memory_fit(deployment)
    external = deployment.external
    return {
        "deployment": deployment,
        **_live(deployment),
        "args": deployment.effective_args,
        "cpu_limit": "" if external else cpu_limit_text(deployment, node),
        "actions": _actions(deployment),
        "scale_form": ScaleForm(initial={"replicas": deployment.replicas}),
        "demand_form": demand_form,
        "fit": fit.message if fit else "",
        "replica_bytes": placement.rank_bytes(deployment, node) if node and not external else None,
        "budget_node": node,
        "budget": demand.node_budget(node) if node else None,
        "bill_checks": bill_check.replica_checks([deployment]),
        "bill_hours": bill_check.hours_of(deployment),
    }


def cpu_limit_text(deployment: Deployment, node: Node | None) -> str:
    """What the engines may use of the CPU, in the admin's terms."""
    if deployment.cpus is not None:
        return f"{deployment.cpus.normalize():f} cores per engine (--cpus)"
    profile = deployment.profile
    headroom = profile.cpu_headroom if profile else None
    if headroom is None:
        return "no limit: the node's every core"
    leave = f"{headroom.normalize():f}"
    if node is None or not node.cpu_count:
        return f"the node's cores minus the {leave} profile {profile} leaves to Tollgate"
    limit = deployment.cpu_limit(node.cpu_count)
    if limit is None:
        return f"no limit: {node} has {node.cpu_count} core, too few to leave {leave} free"
    return (
        f"{limit:g} of {node}'s {node.cpu_count} cores per engine "
        f"(profile {profile} leaves {leave} to Tollgate)"
    )


def _replica_node(deployment: Deployment) -> Node | None:
    """Where Tollgate placed an unpinned deployment's engines (None: nowhere yet)."""
    replica = deployment.replica_set.exclude(node=None).select_related("node").first()
    return replica.node if replica else None


def _demand_initial(deployment: Deployment) -> dict[str, Any]:
    return {name: getattr(deployment, name) for name in DemandForm.base_fields}


@staff_required
def deployment_progress(request: HttpRequest, name: str) -> HttpResponse:
    """htmx: the live part of the detail page (operation progress, replicas, metrics)."""
    deployment = _deployment(name)
    return render(
        request, "console/deployments/_live.html", {"deployment": deployment, **_live(deployment)}
    )


def _live(deployment: Deployment) -> dict[str, Any]:
    op = deployment.operations.first()
    replicas = list(deployment.replica_set.select_related("node").order_by("index"))
    for replica in replicas:
        replica.metrics = queries.replica_metrics(replica)
        # The worker's record (what the gateway routes adapters by): id -> served name.
        held = loaded(replica.pk) if deployment.serves_adapters else {}
        replica.adapters = sorted(held.items(), key=lambda item: item[1])
    return {
        "demand_badge": demand_badge(deployment),
        "op": op,
        "op_replicas": _op_steps(op) if op else [],
        "replicas": replicas,
        "ready_count": sum(r.state == "ready" for r in replicas),
        "recent_ops": deployment.operations.all()[:8],
        "busy": bool(op and op.status in (OperationStatus.QUEUED, OperationStatus.RUNNING)),
        "lora": deployment.serves_adapters,
    }


def _op_steps(op: Operation) -> list[dict[str, Any]]:
    """Per replica of the operation: each start phase done / current / waiting, with a bar."""
    out = []
    for index, info in sorted((op.detail or {}).get("replicas", {}).items()):
        done = info.get("phases", {})
        running = op.status == OperationStatus.RUNNING
        current = op.phase if running and op.phase not in done else ""
        steps = []
        for key, label in PHASES:
            if key in done:
                steps.append(
                    {"key": key, "label": label, "state": "done", "pct": 100, "seconds": done[key]}
                )
            elif key == current:
                pct = op.progress if key in ("pull", "load") else 50
                steps.append(
                    {"key": key, "label": label, "state": "current", "pct": pct, "seconds": None}
                )
            else:
                steps.append({"key": key, "label": label, "state": "", "pct": 0, "seconds": None})
        out.append({"index": index, "steps": steps, "total": done.get("total")})
    return out


def _actions(deployment: Deployment) -> list[Action]:
    url = lambda action: reverse("console:deployment-action", args=[deployment.name, action])  # noqa: E731
    actions = []
    if deployment.external:
        pass
    elif deployment.desired_state == DesiredState.RUNNING:
        actions += [
            Action(
                "Restart",
                url("restart"),
                method="post",
                confirm="Replace every replica, one after the other?",
            ),
            Action(
                "Stop",
                url("stop"),
                method="post",
                style="danger",
                confirm=f"Stop {deployment}? In-flight requests finish first.",
            ),
        ]
    else:
        actions.append(Action("Start", url("start"), method="post", style="primary"))
    actions.append(
        Action(
            "Remove",
            url("remove"),
            method="post",
            style="danger",
            confirm=f"Drain, stop and remove {deployment} for good?",
        )
    )
    return actions


@staff_required
@require_POST
def deployment_action(request: HttpRequest, name: str, action: str) -> HttpResponse:
    deployment, user = _deployment(name), request.user
    if action == "demand":
        return _save_demand(request, deployment)
    act = {
        "start": lambda: services.set_desired_state(user, deployment, DesiredState.RUNNING),
        "stop": lambda: services.set_desired_state(user, deployment, DesiredState.STOPPED),
        "restart": lambda: services.restart_deployment(user, deployment),
        "remove": lambda: services.remove_deployment(user, deployment),
    }.get(action)
    if act is None:
        return HttpResponse(status=404)
    detail = redirect("console:deployment-detail", name=name)
    if action == "remove":
        return service_action(
            request,
            act,
            f"{name} is being drained, stopped and removed.",
            detail,
            onward=redirect("console:deployment-list"),
        )
    return service_action(request, act, f"{name}: {action} requested.", detail)


def _save_demand(request: HttpRequest, deployment: Deployment) -> HttpResponse:
    """The detail page's on-demand form: saved through the service, or the page again with
    the form's errors and the values as typed."""
    form = DemandForm(request.POST)
    return service_form(
        request,
        form,
        lambda f: services.update_deployment(request.user, deployment, **f.service_data()),
        lambda saved_deployment: saved(
            request,
            f"{saved_deployment}: saved ({saved_deployment.get_mode_display().lower()}).",
            "console:deployment-detail",
            name=saved_deployment.name,
        ),
        f"Deployment {deployment.name}",
        cancel=reverse("console:deployment-detail", args=[deployment.name]),
        nav="deployments",
        template="console/deployments/detail.html",
        extra=lambda: _detail_page(_deployment(deployment.name), form),
    )


@staff_required
@require_POST
def deployment_scale(request: HttpRequest, name: str) -> HttpResponse:
    deployment = _deployment(name)
    form = ScaleForm(request.POST)
    detail = redirect("console:deployment-detail", name=name)
    if not form.is_valid():
        messages.error(request, "Replicas: " + " ".join(form.errors.get("replicas", [])))
        return detail
    replicas = form.cleaned_data["replicas"]
    return service_action(
        request,
        lambda: services.update_deployment(request.user, deployment, replicas=replicas),
        f"{name}: scaling to {replicas} replicas.",
        detail,
    )


@staff_required
def deployment_logs(request: HttpRequest, name: str) -> HttpResponse:
    """htmx: the last lines of one replica's engine log."""
    deployment = _deployment(name)
    index = int(request.GET.get("replica", "0") or 0)
    lines = min(int(request.GET.get("lines", "200") or 200), 2000)
    try:
        text = services.replica_logs(deployment, index, lines)
        error = ""
    except ValidationError as exc:
        text, error = "", " ".join(exc.messages)
    return render(
        request,
        "console/deployments/_logs.html",
        {"log": text, "error": error, "index": index, "lines": lines},
    )
