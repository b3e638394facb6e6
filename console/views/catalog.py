"""The model catalogue with prices and price history; nodes. Changes: platform admins."""

import django_filters
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from console import queries
from console.access import staff_required
from console.forms import CatalogModelForm, GrantForm, JoinNodeForm, NodeForm, PriceForm
from console.generic import Action, Column, ListPage, saved, service_action, service_form
from console.templatetags.console import ago, badge, bar, gb, per_mtok, tokens
from deployments import credentials, demand, joining, relay, services
from deployments.access import models_visible_to
from deployments.choices import NodeStatus, Task, Visibility
from deployments.models import CatalogModel, ModelGrant, Node
from metering import services as metering_services
from tenants.access import tenants_of
from tenants.models import Tenant


class ModelFilter(django_filters.FilterSet):
    served_name = django_filters.CharFilter(lookup_expr="icontains", label="Name")
    task = django_filters.ChoiceFilter(choices=Task.choices, empty_label="Any task")
    visibility = django_filters.ChoiceFilter(
        choices=Visibility.choices, empty_label="Any visibility"
    )

    class Meta:
        model = CatalogModel
        fields = ["served_name", "task", "visibility"]


def _price_currency(request: HttpRequest) -> str:
    """The currency prices are shown in: the user's (first) tenant's, else the default."""
    tenant = None if request.user.is_staff else tenants_of(request.user).first()
    return tenant.currency if tenant else settings.TOLLGATE_DEFAULT_CURRENCY


@login_required
def model_list(request: HttpRequest) -> HttpResponse:
    staff, currency = request.user.is_staff, _price_currency(request)
    detail = lambda m: reverse("console:model-detail", args=[m.pk])  # noqa: E731

    def price(m: CatalogModel, part: str) -> str:
        p = queries.current_price(m, currency)
        return per_mtok(getattr(p, part), p.currency) if p else "unpriced"

    columns = [
        Column("Served name", lambda m: m.served_name, sort="served_name", href=detail),
        Column("Task", lambda m: m.get_task_display(), sort="task"),
        Column(
            "Parameters", lambda m: f"{m.params_billions:g} B", sort="params_billions", numeric=True
        ),
        Column("Context", lambda m: tokens(m.context_length), sort="context_length", numeric=True),
        Column(f"Input ({currency})", lambda m: price(m, "input_per_mtok"), numeric=True),
        Column(f"Output ({currency})", lambda m: price(m, "output_per_mtok"), numeric=True),
    ]
    if staff:
        columns.insert(
            3,
            Column(
                "Visibility", lambda m: m.get_visibility_display().split(":")[0], sort="visibility"
            ),
        )
    page = ListPage(
        title="Models & prices" if staff else "Models",
        nav="models",
        queryset=models_visible_to(request.user),
        filterset_class=ModelFilter,
        default_sort="served_name",
        columns=columns,
        actions=[Action("Register model", reverse("console:model-new"), style="primary")]
        if staff
        else [],
        empty_title="No models yet",
        empty_hint=(
            "Register a model (its Hugging Face id, size and context), set its price, then "
            "deploy it."
        )
        if staff
        else "No model is available to your tenant yet; ask a platform admin.",
        empty_action=Action("Register a model", reverse("console:model-new"), style="primary")
        if staff
        else None,
    )
    return page.render(request)


@login_required
def model_detail(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(models_visible_to(request.user), pk=pk)
    staff = request.user.is_staff
    context = {
        "model": model,
        "nav": "models",
        "staff": staff,
        # The model's own versions: its adapters' prices are theirs (metering.models.Price).
        "prices": model.prices.filter(adapter=None)
        .select_related("created_by")
        .order_by("currency", "-effective_from"),
        "current": {
            p.currency: p
            for p in model.prices.filter(adapter=None)
            .order_by("currency", "-effective_from")
            .distinct("currency")
        },
        "price_form": PriceForm(),
        "grant_form": GrantForm(),
    }
    if staff:
        context.update(
            grants=model.grants.select_related("tenant"),
            deployments=model.deployments.select_related("node"),
            grantable=Tenant.objects.exclude(model_grants__model=model),
            actions=[
                Action("Edit", reverse("console:model-edit", args=[pk])),
                Action(
                    "Deploy", reverse("console:deployment-new") + f"?model={pk}", style="primary"
                ),
            ],
        )
    return render(request, "console/models/detail.html", context)


@staff_required
def model_new(request: HttpRequest) -> HttpResponse:
    return service_form(
        request,
        CatalogModelForm(request.POST or None),
        lambda form: services.create_model(request.user, **form.cleaned_data),
        lambda model: saved(
            request,
            f"{model} registered. Next: set its price, then deploy it.",
            "console:model-detail",
            pk=model.pk,
        ),
        "Register a model",
        cancel=reverse("console:model-list"),
        submit="Register",
        nav="models",
    )


@staff_required
def model_edit(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(CatalogModel, pk=pk)
    # The form edits its own copy; the service's audit entry compares with ``model``.
    form = CatalogModelForm(request.POST or None, instance=CatalogModel.objects.get(pk=pk))
    return service_form(
        request,
        form,
        lambda f: services.update_model(request.user, model, **f.cleaned_data),
        lambda _: saved(request, f"{model} saved.", "console:model-detail", pk=pk),
        f"Edit {model}",
        nav="models",
        cancel=reverse("console:model-detail", args=[pk]),
    )


@staff_required
def price_new(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(CatalogModel, pk=pk)
    intro = "A new price is a new version from its start; billed requests keep the price they had."
    return price_page(request, model, None, "models", "console:model-detail", intro)


def price_page(
    request: HttpRequest,
    model: CatalogModel,
    adapter: object | None,
    nav: str,
    back: str,
    intro: str,
) -> HttpResponse:
    """A new price version for a model, or for one of its adapters (``back``: the page of
    the one priced)."""
    priced = adapter or model

    def set_price(form: PriceForm) -> object:
        data = form.cleaned_data
        return metering_services.set_price(
            request.user,
            model,
            data["input_per_mtok"],
            data["cached_input_per_mtok"],
            data["output_per_mtok"],
            currency=data["currency"],
            effective_from=data["effective_from"],
            adapter=adapter,
        )

    return service_form(
        request,
        PriceForm(request.POST or None),
        set_price,
        lambda price: saved(
            request,
            f"New {price.currency} price for {priced} recorded; earlier requests keep theirs.",
            back,
            pk=priced.pk,
        ),
        f"New price for {priced}",
        nav=nav,
        submit="Set price",
        cancel=reverse(back, args=[priced.pk]),
        intro=intro,
    )


@staff_required
@require_POST
def model_grant(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(CatalogModel, pk=pk)
    form = GrantForm(request.POST)
    detail = redirect("console:model-detail", pk=pk)
    if not form.is_valid():
        messages.error(request, "Choose a tenant to grant the model to.")
        return detail
    tenant = form.cleaned_data["tenant"]
    return service_action(
        request,
        lambda: services.grant_model(request.user, model, tenant),
        f"{tenant} may now use {model}.",
        detail,
    )


@staff_required
@require_POST
def model_ungrant(request: HttpRequest, pk: int, grant_id: int) -> HttpResponse:
    grant = get_object_or_404(ModelGrant, pk=grant_id, model_id=pk)
    services.revoke_grant(request.user, grant)
    messages.success(request, f"{grant.tenant} may no longer use {grant.model}.")
    return redirect("console:model-detail", pk=pk)


# --- Nodes ------------------------------------------------------------------------------


class NodeFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=NodeStatus.choices, empty_label="Any status")

    class Meta:
        model = Node
        fields = ["status"]


def _memory(node: Node) -> str:
    if not node.total_memory_bytes:
        return "unknown until the first heartbeat"
    if not node.available_memory_bytes:
        return f"{gb(node.total_memory_bytes)} total"
    used = node.total_memory_bytes - node.available_memory_bytes
    return format_html(
        "{} {} of {} in use",
        bar(used, node.total_memory_bytes),
        gb(used),
        gb(node.total_memory_bytes),
    )


@staff_required
def node_list(request: HttpRequest) -> HttpResponse:
    detail = lambda n: reverse("console:node-detail", args=[n.pk])  # noqa: E731
    page = ListPage(
        title="Nodes",
        nav="nodes",
        queryset=Node.objects.all(),
        filterset_class=NodeFilter,
        default_sort="name",
        intro=(
            "Docker hosts that run engines: this box, and boxes joined with a node agent "
            "(no control-plane secret on them; revoke one from its page)."
        ),
        columns=[
            Column("Name", lambda n: n.name, sort="name", href=detail),
            Column("Status", lambda n: badge(n.status, n.get_status_display()), sort="status"),
            Column("Arch", lambda n: n.arch, sort="arch"),
            Column(
                "GPU", lambda n: f"{n.gpu_count} × {n.gpu_description}" if n.gpu_count else "none"
            ),
            Column("Memory", _memory, sort="total_memory_bytes"),
            Column("Last heartbeat", lambda n: ago(n.last_seen_at), sort="last_seen_at"),
        ],
        actions=[
            Action("Join a node", reverse("console:node-join"), style="primary"),
            Action("Register node", reverse("console:node-new")),
        ],
        empty_title="No nodes yet",
        empty_hint=(
            "`manage.py bootstrap` registers the local Docker host; register more boxes here."
        ),
        empty_action=Action("Register a node", reverse("console:node-new"), style="primary"),
    )
    return page.render(request)


def _register_node(request: HttpRequest, form: NodeForm) -> Node:
    data = form.service_data()
    return services.register_node(request.user, data.pop("name"), **data)


@staff_required
def node_new(request: HttpRequest) -> HttpResponse:
    return service_form(
        request,
        NodeForm(request.POST or None),
        lambda form: _register_node(request, form),
        lambda node: saved(
            request,
            f"Node {node} registered. Start its worker with -Q {node.queue}.",
            "console:node-detail",
            pk=node.pk,
        ),
        "Register a node",
        cancel=reverse("console:node-list"),
        submit="Register",
        nav="nodes",
    )


def _join_page(request: HttpRequest, issued: joining.IssuedJoinToken) -> HttpResponse:
    # The token exists only in this response: never cached.
    response = render(request, "console/nodes/join.html", {"issued": issued, "nav": "nodes"})
    response["Cache-Control"] = "no-store"
    return response


@staff_required
def node_join(request: HttpRequest) -> HttpResponse:
    """Issue a one-time join token and show the command to run on the new box."""
    return service_form(
        request,
        JoinNodeForm(request.POST or None),
        lambda form: joining.create_join_token(request.user, **form.cleaned_data),
        lambda issued: _join_page(request, issued),
        "Join a node",
        cancel=reverse("console:node-list"),
        submit="Create join token",
        nav="nodes",
    )


@staff_required
@require_POST
def node_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    """Cut a joined node off: its credential stops working, its replicas leave routing."""
    node = get_object_or_404(Node, pk=pk)
    return service_action(
        request,
        lambda: credentials.revoke_node(request.user, node),
        f"Node {node} is revoked: its agent is cut off and its engines left routing.",
        redirect("console:node-detail", pk=pk),
    )


@staff_required
def node_detail(request: HttpRequest, pk: int) -> HttpResponse:
    node = get_object_or_404(Node, pk=pk)
    return render(
        request,
        "console/nodes/detail.html",
        {
            "node": node,
            "nav": "nodes",
            "memory": _memory(node),
            "budget": demand.node_budget(node),
            "budget_node": node,
            "joined": relay.is_relayed(node.docker_url),
            "deployments": node.deployments.select_related("model"),
            "replicas": node.replicas.select_related("deployment"),
        },
    )
