"""Tenants: list, create, edit, suspend/activate, and the tenant's own page.

Platform admins see and change every tenant; tenant users see only theirs (others 404).
"""

import json
from datetime import timedelta
from typing import Any

import django_filters
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from console import queries
from console.access import staff_required, tenant_or_404
from console.forms import TenantForm
from console.generic import Action, Column, ListPage, saved, service_action, service_form
from console.templatetags.console import badge, money, tokens
from deployments.access import models_for_tenant
from metering.forecast import tenant_forecasts
from metering.services import usage_rollups_visible_to
from metering.usage import quota_status
from tenants import services
from tenants.access import is_tenant_admin, keys_visible_to, role_in, tenants_of
from tenants.choices import Priority, TenantStatus
from tenants.models import Tenant


class TenantFilter(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains", label="Name")
    status = django_filters.ChoiceFilter(choices=TenantStatus.choices, empty_label="Any status")
    priority = django_filters.ChoiceFilter(choices=Priority.choices, empty_label="Any priority")

    class Meta:
        model = Tenant
        fields = ["name", "status", "priority"]


def _limit(value: Any, unit: str) -> str:
    return "unlimited" if value is None else f"{value:,} {unit}"


@login_required
def tenant_list(request: HttpRequest) -> HttpResponse:
    staff = request.user.is_staff
    detail = lambda t: reverse("console:tenant-detail", args=[t.slug])  # noqa: E731
    page = ListPage(
        title="Tenants" if staff else "My tenants",
        queryset=tenants_of(request.user),
        filterset_class=TenantFilter,
        default_sort="name",
        nav="tenants",
        columns=[
            Column("Name", lambda t: t.name, sort="name", href=detail),
            Column("Slug", lambda t: t.slug, sort="slug"),
            Column("Status", lambda t: badge(t.status, t.get_status_display()), sort="status"),
            Column("Priority", lambda t: t.get_priority_display(), sort="priority"),
            Column(
                "Requests/min",
                lambda t: _limit(t.requests_per_minute, "req/min"),
                sort="requests_per_minute",
                numeric=True,
            ),
            Column(
                "Tokens/min",
                lambda t: _limit(t.tokens_per_minute, "tokens/min"),
                sort="tokens_per_minute",
                numeric=True,
            ),
            Column("Quota", lambda t: _quota_text(t)),
        ],
        actions=[Action("New tenant", reverse("console:tenant-new"), style="primary")]
        if staff
        else [],
        empty_title="No tenants yet",
        empty_hint="Create a tenant, then issue it an API key so it can call models."
        if staff
        else "You do not belong to any tenant yet. Ask a platform admin to add you.",
        empty_action=Action(
            "Create the first tenant", reverse("console:tenant-new"), style="primary"
        )
        if staff
        else None,
    )
    return page.render(request)


def _quota_text(tenant: Tenant) -> str:
    parts = []
    if tenant.quota_tokens is not None:
        parts.append(tokens(tenant.quota_tokens))
    if tenant.quota_amount is not None:
        parts.append(money(tenant.quota_amount, tenant.currency))
    return (
        f"{' and '.join(parts)} {tenant.get_quota_period_display().lower()}"
        if parts
        else "no quota"
    )


@staff_required
def tenant_new(request: HttpRequest) -> HttpResponse:
    return service_form(
        request,
        TenantForm(request.POST or None),
        lambda form: services.create_tenant(request.user, **form.service_data()),
        lambda tenant: saved(
            request,
            f"Tenant {tenant.name} created. Next: issue it an API key.",
            "console:tenant-detail",
            slug=tenant.slug,
        ),
        "New tenant",
        cancel=reverse("console:tenant-list"),
        submit="Create tenant",
        nav="tenants",
    )


@staff_required
def tenant_edit(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_or_404(request.user, slug)
    # A fresh row: the form writes its values into its own instance, and the service's
    # audit entry must see the before/after difference.
    form = TenantForm(request.POST or None, instance=Tenant.objects.get(pk=tenant.pk))
    return service_form(
        request,
        form,
        lambda f: services.update_tenant(request.user, tenant, **f.service_data()),
        lambda _: saved(
            request, f"Tenant {tenant.name} saved.", "console:tenant-detail", slug=tenant.slug
        ),
        f"Edit {tenant.name}",
        cancel=reverse("console:tenant-detail", args=[tenant.slug]),
        nav="tenants",
    )


@staff_required
@require_POST
def tenant_status(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_or_404(request.user, slug)
    status = request.POST.get("status") or request.GET.get("status", "")
    verb = (
        "suspended: its keys stop working within a second"
        if status == TenantStatus.SUSPENDED
        else "active again"
    )
    return service_action(
        request,
        lambda: services.set_tenant_status(request.user, tenant, status),
        f"{tenant.name} is {verb}.",
        redirect("console:tenant-detail", slug=tenant.slug),
    )


@login_required
def tenant_detail(request: HttpRequest, slug: str) -> HttpResponse:
    user = request.user
    tenant = tenant_or_404(user, slug)
    admin = is_tenant_admin(user, tenant.pk)
    now = timezone.now()
    keys = keys_visible_to(user).filter(tenant=tenant)
    rollups = usage_rollups_visible_to(user).filter(tenant=tenant)
    start = (now - timedelta(days=29)).replace(hour=0, minute=0, second=0, microsecond=0)
    series = queries.usage_series(rollups.filter(hour__gte=start), "model", "day", start, now)
    models = [
        {"model": m, "price": queries.current_price(m, tenant.currency)}
        for m in models_for_tenant(tenant).order_by("served_name")
    ]
    actions = []
    if user.is_staff:
        actions.append(Action("Edit", reverse("console:tenant-edit", args=[slug])))
        target = (
            TenantStatus.ACTIVE
            if tenant.status == TenantStatus.SUSPENDED
            else TenantStatus.SUSPENDED
        )
        actions.append(
            Action(
                "Activate" if target == TenantStatus.ACTIVE else "Suspend",
                reverse("console:tenant-status", args=[slug]) + f"?status={target}",
                method="post",
                style="" if target == TenantStatus.ACTIVE else "danger",
                confirm=""
                if target == TenantStatus.ACTIVE
                else f"Suspend {tenant.name}? Its keys stop working at once.",
            )
        )
    if admin:
        actions.insert(
            0,
            Action("New API key", reverse("console:key-new") + f"?tenant={slug}", style="primary"),
        )
    context = {
        "tenant": tenant,
        "nav": "tenants",
        "admin": admin,
        "role": role_in(user, tenant),
        "quota": quota_status(tenant, now),
        "forecasts": tenant_forecasts(tenant, now),
        "keys": keys[:20],
        "key_count": keys.count(),
        "models": models,
        "series_json": json.dumps(series),
        "series": series,
        "base_url": request.build_absolute_uri("/v1"),
        "actions": actions,
        "members": tenant.memberships.select_related("user") if admin else [],
        "example_model": models[0]["model"].served_name if models else "MODEL",
    }
    return render(request, "console/tenants/detail.html", context)
