"""LoRA adapters: list, detail (its check, the replicas holding it, its price, its usage),
add, edit, delete, check again, new price.

Everyone sees the adapters their tenants may call (``deployments.access``), so another
tenant's private adapter answers 404, exactly like one that does not exist. The admins of
the tenant that owns it and platform admins manage it (403 for others who may only call
it); only platform admins choose its owner, visibility, grants and prices. Every change is
a ``deployments.adapters`` (or ``metering.services``) service.
"""

from typing import Any

import django_filters
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_POST

from console.access import staff_required
from console.forms import AdapterForm
from console.generic import Action, Column, ListPage, saved, service_action, service_form
from console.templatetags.console import badge, size
from console.views.catalog import price_page
from deployments import adapter_uploads as uploads
from deployments import adapters as services
from deployments.access import adapters_visible_to, models_for_tenant, models_visible_to
from deployments.choices import AdapterStatus, Task
from deployments.models import Adapter, CatalogModel, Replica
from metering import services as metering_services
from metering.models import Price
from tenants.access import (
    admin_tenant_ids,
    admin_tenants,
    member_tenant_ids,
    report_tenant_ids,
    tenants_of,
)
from tenants.models import Tenant

NAV = "adapters"


class AdapterFilter(django_filters.FilterSet):
    served_name = django_filters.CharFilter(lookup_expr="icontains", label="Name")
    base = django_filters.ModelChoiceFilter(
        queryset=CatalogModel.objects.none(), empty_label="Any base model", label="Base model"
    )
    tenant = django_filters.ModelChoiceFilter(
        queryset=Tenant.objects.none(), to_field_name="slug", empty_label="Any owner", label="Owner"
    )
    status = django_filters.ChoiceFilter(choices=AdapterStatus.choices, empty_label="Any status")

    class Meta:
        model = Adapter
        fields = ["served_name", "base", "tenant", "status"]

    def __init__(self, *args: object, request: HttpRequest, **kwargs: object) -> None:
        super().__init__(*args, request=request, **kwargs)
        bases = models_visible_to(request.user).filter(task=Task.GENERATE)
        self.filters["base"].queryset = bases.order_by("served_name")
        self.filters["tenant"].queryset = tenants_of(request.user).order_by("name")


def manages(user: Any, adapter: Adapter) -> bool:
    """Platform admins, and the admins of the tenant that owns it."""
    return user.is_staff or (
        adapter.tenant_id is not None and adapter.tenant_id in admin_tenant_ids(user)
    )


def _owner(user: Any, adapter: Adapter, mine: set[int] | None = None) -> str:
    """Whose it is, as far as this user may know: another tenant's shared adapter names no
    tenant. ``mine``: the user's tenants' ids, when known already."""
    if adapter.tenant_id is None:
        return "the platform"
    if user.is_staff or adapter.tenant_id in (member_tenant_ids(user) if mine is None else mine):
        return adapter.tenant.name
    return "another tenant (shared with yours)"


def _visible(request: HttpRequest) -> QuerySet[Adapter]:
    """What the admin API lists: everything for platform admins; for others what their
    tenants may call, and their own tenants' adapters even when the base went out of their
    reach (so they can fix or delete them)."""
    user, rows = request.user, Adapter.objects.select_related("base", "tenant")
    if user.is_staff:
        return rows
    callable_ = adapters_visible_to(user).values("pk")
    return rows.filter(Q(tenant_id__in=admin_tenant_ids(user)) | Q(pk__in=callable_))


def _adapter(request: HttpRequest, pk: int) -> Adapter:
    return get_object_or_404(_visible(request), pk=pk)


def _managed(request: HttpRequest, pk: int) -> Adapter:
    adapter = _adapter(request, pk)
    if not manages(request.user, adapter):
        raise PermissionDenied("Only the admins of its tenant can change this adapter.")
    return adapter


@login_required
def adapter_list(request: HttpRequest) -> HttpResponse:
    user = request.user
    can_add, mine = user.is_staff or admin_tenants(user).exists(), member_tenant_ids(user)
    detail = lambda a: reverse("console:adapter-detail", args=[a.pk])  # noqa: E731
    new = reverse("console:adapter-new")
    columns = [
        Column("Served name", lambda a: a.served_name, sort="served_name", href=detail),
        Column("Base model", lambda a: a.base.served_name, sort="base__served_name"),
        # Sorting by owner would rank the tenants of shared adapters, whom it does not name.
        Column(
            "Owner", lambda a: _owner(user, a, mine), sort="tenant__name" if user.is_staff else ""
        ),
        Column("Status", lambda a: badge(a.status, a.get_status_display()), sort="status"),
        Column("Rank", lambda a: a.rank, sort="rank", numeric=True),
        Column("Size", lambda a: size(a.size_bytes) if a.size_bytes else "", numeric=True),
        Column("Kept loaded", lambda a: "yes" if a.pinned else "no", sort="pinned"),
    ]
    if user.is_staff:
        columns.insert(
            3,
            Column(
                "Visibility", lambda a: a.get_visibility_display().split(":")[0], sort="visibility"
            ),
        )
    page = ListPage(
        title="LoRA adapters",
        nav=NAV,
        queryset=_visible(request),
        filterset_class=AdapterFilter,
        default_sort="served_name",
        intro="Fine-tuned variants of a base model, served by the base's engines. Clients call "
        "one by its served name as model, like any model.",
        columns=columns,
        actions=[Action("Add adapter", new, style="primary")] if can_add else [],
        empty_title="No adapters yet",
        empty_hint="Add one by its hub id, a folder in the model cache or an upload of its "
        "files: they are checked on the nodes serving its base with adapters enabled."
        if can_add
        else "No adapter is available to your tenant yet; your tenant's admins add them.",
        empty_action=Action("Add an adapter", new, style="primary") if can_add else None,
    )
    return page.render(request)


# --- Detail --------------------------------------------------------------------------------


def holders(adapter: Adapter) -> list[Replica]:
    """The ready replicas of its base that hold the adapter now (the worker's record in
    Redis, which the gateway routes by)."""
    return services.replicas_holding([adapter])[adapter.pk]


def _currencies(request: HttpRequest, adapter: Adapter) -> list[str]:
    """Platform admins: every currency the adapter or its base has a price in. Others: their
    tenant's (the owner's when they belong to it)."""
    if request.user.is_staff:
        rows = Price.objects.filter(Q(adapter=None) | Q(adapter=adapter), model_id=adapter.base_id)
        found = sorted(set(rows.values_list("currency", flat=True)))
        return found or [settings.TOLLGATE_DEFAULT_CURRENCY]
    mine = tenants_of(request.user).order_by("name")
    tenant = mine.filter(pk=adapter.tenant_id).first() or mine.first()
    return [tenant.currency if tenant else settings.TOLLGATE_DEFAULT_CURRENCY]


def _prices(request: HttpRequest, adapter: Adapter) -> list[dict[str, Any]]:
    """Per currency: the price in force now and whether it is the adapter's own."""
    now = timezone.now()
    rows = []
    for currency in _currencies(request, adapter):
        price = metering_services.price_at(adapter.base, currency, now, adapter=adapter)
        rows.append({"currency": currency, "price": price, "own": bool(price and price.adapter_id)})
    return rows


def usage_url(request: HttpRequest, adapter: Adapter) -> str:
    """The usage page filtered to the adapter, for those who may read usage reports."""
    scope = report_tenant_ids(request.user)
    if scope is not None and not scope:
        return ""  # members read no usage reports
    return reverse("console:usage") + "?" + urlencode({"adapter": adapter.served_name})


def playground_url(user: Any, adapter: Adapter) -> str:
    """The playground with the adapter chosen, billing its owner when the user is in it."""
    query = {"model": adapter.served_name}
    if adapter.tenant_id is not None and tenants_of(user).filter(pk=adapter.tenant_id).exists():
        query["tenant"] = adapter.tenant.slug
    return reverse("console:playground") + "?" + urlencode(query)


def _live(request: HttpRequest, adapter: Adapter) -> dict[str, Any]:
    """What the page refreshes while open: its check and what it found, and the replicas
    holding it."""
    user = request.user
    manager = manages(user, adapter)
    return {
        "adapter": adapter,
        "check": adapter.operations.first(),
        "holders": holders(adapter),
        "serving": services.serving_deployments(adapter.base),
        "manager": manager,
        "staff": user.is_staff,
        "owner": _owner(user, adapter),
        "base_visible": models_visible_to(user).filter(pk=adapter.base_id).exists(),
        "grant_count": adapter.grants.count() if manager and not user.is_staff else 0,
        "playground_url": playground_url(user, adapter),
    }


def _actions(request: HttpRequest, adapter: Adapter) -> list[Action]:
    if not manages(request.user, adapter):
        return []
    actions = [Action("Edit", reverse("console:adapter-edit", args=[adapter.pk]))]
    if request.user.is_staff:
        actions.append(Action("Set a price", reverse("console:adapter-price", args=[adapter.pk])))
    actions.append(
        Action("Delete", reverse("console:adapter-delete", args=[adapter.pk]), style="danger")
    )
    return actions


@login_required
def adapter_detail(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = _adapter(request, pk)
    context = {
        **_live(request, adapter),
        "nav": NAV,
        "actions": _actions(request, adapter),
        "prices": _prices(request, adapter),
        "usage_url": usage_url(request, adapter),
    }
    if request.user.is_staff:
        context["grants"] = adapter.grants.select_related("tenant").order_by("tenant__name")
    return render(request, "console/adapters/detail.html", context)


@login_required
def adapter_live(request: HttpRequest, pk: int) -> HttpResponse:
    """htmx: the adapter's check and the replicas holding it, refreshed while the page is open."""
    adapter = _adapter(request, pk)
    return render(request, "console/adapters/_live.html", _live(request, adapter))


@login_required
@require_POST
def adapter_check(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = _managed(request, pk)
    return service_action(
        request,
        lambda: services.check_again(request.user, adapter),
        f"{adapter}: its files are being checked again.",
        redirect("console:adapter-detail", pk=pk),
    )


# --- Add, edit, delete, price ----------------------------------------------------------------


def _bases(tenants: list[Tenant]) -> QuerySet[CatalogModel]:
    """Chat models any of the tenants may call (the form checks the pair it gets)."""
    ids: set[int] = set()
    for tenant in tenants:
        ids |= set(models_for_tenant(tenant).values_list("pk", flat=True))
    return CatalogModel.objects.filter(pk__in=ids, task=Task.GENERATE).order_by("served_name")


def _form(request: HttpRequest, adapter: Adapter | None = None) -> AdapterForm:
    """Platform admins: any owner and chat model. Tenant admins: their tenants (the
    adapter's own when editing) and the models those may call."""
    user, editing, owner = request.user, adapter is not None, None
    if user.is_staff:
        tenants = Tenant.objects.order_by("name")
        bases = CatalogModel.objects.filter(task=Task.GENERATE).order_by("served_name")
    else:
        mine = admin_tenants(user).order_by("name")
        tenants = mine.filter(pk=adapter.tenant_id) if editing else mine
        if not tenants.exists():
            raise PermissionDenied("Only tenant admins can add adapters.")
        bases = _bases(list(tenants))
        owner = tenants.first() if tenants.count() == 1 else None
    initial = AdapterForm.initial_for(adapter) if editing else {}
    if not editing and request.GET.get("base", "").isdigit():
        initial["base"] = bases.filter(pk=request.GET["base"]).first()
    return AdapterForm(
        request.POST or None,
        request.FILES or None,
        initial=initial,
        staff=user.is_staff,
        tenants=tenants,
        bases=bases,
        owner=owner,
        editing=editing,
    )


@transaction.atomic
def _create(request: HttpRequest, form: AdapterForm) -> Adapter:
    if archive := form.uploaded():
        adapter = uploads.create_uploaded_adapter(request.user, archive, **form.service_data())
    else:
        adapter = services.create_adapter(request.user, **form.service_data())
    if (grants := form.granted()) is not None:
        services.set_adapter_grants(request.user, adapter, grants)
    return adapter


@transaction.atomic
def _update(request: HttpRequest, adapter: Adapter, form: AdapterForm) -> Adapter:
    adapter = services.update_adapter(request.user, adapter, **form.service_data())
    if archive := form.uploaded():
        adapter = uploads.replace_adapter_files(request.user, adapter, archive)
    if (grants := form.granted()) is not None:
        services.set_adapter_grants(request.user, adapter, grants)
    return adapter


def _too_large(request: HttpRequest) -> HttpResponse | None:
    """Back to the form, saying why, when an upload is too large to parse at all."""
    if request.method != "POST":
        return None
    try:
        uploads.check_request_size(request.META.get("CONTENT_LENGTH"))
        _ = request.FILES  # parsed (the CSRF check may have already): cut off while read?
        uploads.check_not_cut_off(request)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect(request.get_full_path())
    return None


@login_required
def adapter_new(request: HttpRequest) -> HttpResponse:
    if refused := _too_large(request):
        return refused
    return service_form(
        request,
        _form(request),
        lambda form: _create(request, form),
        lambda adapter: saved(
            request,
            f"{adapter} added. Its files are checked next; then clients can call it.",
            "console:adapter-detail",
            pk=adapter.pk,
        ),
        "Add a LoRA adapter",
        cancel=reverse("console:adapter-list"),
        submit="Add adapter",
        nav=NAV,
        intro="Give its hub id (downloaded into each node's cache like a model), a folder in "
        "the model cache, or upload its files. Each node serving the base with adapters "
        "enabled checks them: adapter_config.json, safetensors weights only, a rank the "
        "base's engines serve.",
    )


@login_required
def adapter_edit(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = _managed(request, pk)
    if refused := _too_large(request):
        return refused
    # The service changes its own copy; the page keeps the name it had for its title.
    copy = Adapter.objects.select_related("base", "tenant").get(pk=pk)
    return service_form(
        request,
        _form(request, copy),
        lambda form: _update(request, copy, form),
        lambda _: saved(request, f"{adapter} saved.", "console:adapter-detail", pk=pk),
        f"Edit {adapter}",
        cancel=reverse("console:adapter-detail", args=[pk]),
        nav=NAV,
        intro="A new source, new files or a new base are checked again before clients can call it.",
    )


@login_required
def adapter_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """GET: the confirmation page; POST: delete (refused once it has usage)."""
    adapter = _managed(request, pk)
    if request.method == "POST":
        return service_action(
            request,
            lambda: services.delete_adapter(request.user, adapter),
            f"{adapter} is deleted: clients can no longer call it.",
            redirect("console:adapter-detail", pk=pk),
            onward=redirect("console:adapter-list"),
        )
    return render(
        request,
        "console/adapters/delete.html",
        {"adapter": adapter, "nav": NAV, "holders": holders(adapter)},
    )


@staff_required
def adapter_price(request: HttpRequest, pk: int) -> HttpResponse:
    adapter = get_object_or_404(Adapter.objects.select_related("base"), pk=pk)
    intro = (
        f"Until it has a price of its own in a currency, {adapter} is billed at its base's "
        f"({adapter.base}). A new price is a new version from its start."
    )
    return price_page(request, adapter.base, adapter, NAV, "console:adapter-detail", intro)
