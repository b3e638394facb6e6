"""Inference API keys: list, issue (the secret is shown once), edit, revoke.

Tenant admins manage their tenant's keys; members see the keys they created (403 on
changes); another tenant's key is 404. The same scoping and services as the admin API.
"""

import django_filters
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from console.access import require_tenant_admin
from console.forms import KeyForm
from console.generic import Action, Column, ListPage, saved, service_form
from console.templatetags.console import ago, badge
from core.credentials import unexpired_filter
from deployments.access import models_visible_to
from metering.forecast import key_forecasts
from tenants import services
from tenants.access import admin_tenants, is_tenant_admin, keys_visible_to, tenants_of
from tenants.models import ApiKey, Tenant


class KeyFilter(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains", label="Name")
    tenant = django_filters.ModelChoiceFilter(
        queryset=Tenant.objects.none(), to_field_name="slug", empty_label="All tenants"
    )
    state = django_filters.ChoiceFilter(
        choices=[("active", "Active"), ("expired", "Expired"), ("revoked", "Revoked")],
        method="by_state",
        empty_label="Any state",
        label="State",
    )

    class Meta:
        model = ApiKey
        fields = ["name", "tenant", "state"]

    def __init__(self, *args: object, request: HttpRequest, **kwargs: object) -> None:
        super().__init__(*args, request=request, **kwargs)
        self.filters["tenant"].queryset = tenants_of(request.user)

    def by_state(self, queryset: object, name: str, value: str) -> object:
        # The states the list's status column shows (ApiKey.status): revoked wins over expired.
        if value == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        live = unexpired_filter(timezone.now())
        return queryset.filter(revoked_at__isnull=True).filter(live if value == "active" else ~live)


@login_required
def key_list(request: HttpRequest) -> HttpResponse:
    can_issue = admin_tenants(request.user).exists()
    detail = lambda k: reverse("console:key-detail", args=[k.pk])  # noqa: E731
    new = reverse("console:key-new")
    page = ListPage(
        title="API keys",
        queryset=keys_visible_to(request.user),
        filterset_class=KeyFilter,
        default_sort="-created_at",
        nav="keys",
        intro=""
        if request.user.is_staff or can_issue
        else "These are the keys you created; a tenant admin manages the others.",
        columns=[
            Column("Name", lambda k: k.name, sort="name", href=detail),
            Column("Key", lambda k: k.masked),
            Column("Tenant", lambda k: k.tenant.name, sort="tenant__name"),
            Column("Status", lambda k: badge(k.status), sort="revoked_at"),
            Column("Created", lambda k: k.created_at.strftime("%Y-%m-%d %H:%M"), sort="created_at"),
            Column(
                "Expires",
                lambda k: k.expires_at.strftime("%Y-%m-%d %H:%M") if k.expires_at else "never",
                sort="expires_at",
            ),
            Column("Last used", lambda k: ago(k.last_used_at), sort="last_used_at"),
        ],
        actions=[Action("New API key", new, style="primary")] if can_issue else [],
        empty_title="No API keys yet",
        empty_hint="A key lets a program call the models through /v1. It is shown once when issued."
        if can_issue
        else "Ask a tenant admin of your tenant to issue you a key.",
        empty_action=Action("Issue a key", new, style="primary") if can_issue else None,
    )
    return page.render(request)


def _visible_key(request: HttpRequest, pk: int) -> ApiKey:
    return get_object_or_404(keys_visible_to(request.user), pk=pk)


def _issue(request: HttpRequest, form: KeyForm) -> services.IssuedKey:
    tenant = form.cleaned_data["tenant"]
    require_tenant_admin(request.user, tenant)
    return services.issue_api_key(request.user, tenant, **form.service_data())


def _created_page(request: HttpRequest, issued: services.IssuedKey) -> HttpResponse:
    # Rendered, not redirected: the plaintext exists only in this response.
    response = render(
        request,
        "console/keys/created.html",
        {
            "key": issued.key,
            "plaintext": issued.plaintext,
            "nav": "keys",
            "base_url": request.build_absolute_uri("/v1"),
        },
    )
    response["Cache-Control"] = "no-store"
    return response


@login_required
def key_new(request: HttpRequest) -> HttpResponse:
    tenants = admin_tenants(request.user)
    if not tenants.exists():
        raise PermissionDenied("Only tenant admins can issue keys.")
    initial = {}
    if request.GET.get("tenant"):
        initial["tenant"] = tenants.filter(slug=request.GET["tenant"]).first()
    form = KeyForm(
        request.POST or None,
        initial=initial,
        tenants=tenants,
        models=models_visible_to(request.user),
    )
    return service_form(
        request,
        form,
        lambda f: _issue(request, f),
        lambda issued: _created_page(request, issued),
        "New API key",
        cancel=reverse("console:key-list"),
        submit="Issue key",
        nav="keys",
        intro="The key is shown once, right after you issue it. Store it in your secret manager.",
    )


@login_required
def key_detail(request: HttpRequest, pk: int) -> HttpResponse:
    key = _visible_key(request, pk)
    admin = is_tenant_admin(request.user, key.tenant_id)
    actions = []
    if admin and key.status != "revoked":
        actions = [
            Action("Edit", reverse("console:key-edit", args=[pk])),
            Action(
                "Revoke",
                reverse("console:key-revoke", args=[pk]),
                method="post",
                style="danger",
                confirm=f"Revoke {key.name}? Programs using it stop working within a second.",
            ),
        ]
    return render(
        request,
        "console/keys/detail.html",
        {
            "key": key,
            "nav": "keys",
            "actions": actions,
            "models": list(key.allowed_models.all()),
            "forecasts": key_forecasts(key, timezone.now()),
        },
    )


@login_required
def key_edit(request: HttpRequest, pk: int) -> HttpResponse:
    key = _visible_key(request, pk)
    require_tenant_admin(request.user, key.tenant)
    form = KeyForm(
        request.POST or None,
        initial=KeyForm.initial_for(key),
        tenants=Tenant.objects.none(),
        models=models_visible_to(request.user),
        editing=True,
    )
    return service_form(
        request,
        form,
        lambda f: services.update_api_key(request.user, key, **f.service_data()),
        lambda _: saved(request, f"Key {key.name} saved.", "console:key-detail", pk=pk),
        f"Edit key {key.name}",
        nav="keys",
        cancel=reverse("console:key-detail", args=[pk]),
    )


@login_required
@require_POST
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    key = _visible_key(request, pk)
    require_tenant_admin(request.user, key.tenant)
    services.revoke_api_key(request.user, key)
    messages.success(request, f"Key {key.name} ({key.masked}) is revoked.")
    return redirect("console:key-detail", pk=pk)
