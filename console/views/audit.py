"""The audit log: who changed what. Platform admins: all; tenant admins: their tenants'."""

from typing import Any

import django_filters
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from console.generic import Column, ListPage
from tenants.access import admin_tenant_ids, admin_tenants, audit_visible_to
from tenants.choices import AuditAction
from tenants.models import AuditLog, Tenant


class AuditFilter(django_filters.FilterSet):
    tenant = django_filters.ModelChoiceFilter(
        queryset=Tenant.objects.none(), to_field_name="slug", empty_label="All tenants"
    )
    action = django_filters.ChoiceFilter(choices=AuditAction.choices, empty_label="Any action")
    object_type = django_filters.CharFilter(label="Object type")
    actor_label = django_filters.CharFilter(lookup_expr="icontains", label="Who")

    class Meta:
        model = AuditLog
        fields = ["tenant", "action", "object_type", "actor_label"]

    def __init__(self, *args: object, request: HttpRequest, **kwargs: object) -> None:
        super().__init__(*args, request=request, **kwargs)
        self.filters["tenant"].queryset = admin_tenants(request.user)


def readable(value: Any) -> str:
    """An audited value as a person reads it, never a Python repr."""
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(readable(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {readable(v)}" for k, v in value.items()) if value else "none"
    return str(value)


def _change(value: Any) -> str:
    # {field: [before, after]} from tenants.audit.diff; anything else is one value.
    if isinstance(value, list) and len(value) == 2:
        return f"{readable(value[0])} → {readable(value[1])}"
    return readable(value)


def _changes(entry: AuditLog) -> str:
    if not entry.changes:
        return ""
    if not isinstance(entry.changes, dict):
        return readable(entry.changes)
    return format_html_join(
        mark_safe("<br>"),
        "<code>{}</code>: {}",
        ((k, _change(v)) for k, v in entry.changes.items()),
    )


@login_required
def audit_list(request: HttpRequest) -> HttpResponse:
    if not request.user.is_staff and not admin_tenant_ids(request.user):
        raise PermissionDenied("Only platform and tenant admins can read the audit log.")
    page = ListPage(
        title="Audit log",
        nav="audit",
        queryset=audit_visible_to(request.user).select_related("tenant"),
        filterset_class=AuditFilter,
        default_sort="-at",
        per_page=50,
        columns=[
            Column("When (UTC)", lambda e: e.at.strftime("%Y-%m-%d %H:%M:%S"), sort="at"),
            Column("Who", lambda e: e.actor_label, sort="actor_label"),
            Column("Action", lambda e: e.get_action_display(), sort="action"),
            Column(
                "Object",
                lambda e: format_html(
                    "{} <span class='muted'>{}</span>", e.object_repr, e.object_type
                ),
                sort="object_type",
            ),
            Column("Tenant", lambda e: e.tenant.slug if e.tenant else "", sort="tenant__slug"),
            Column("Changes", _changes),
        ],
        empty_title="Nothing recorded yet",
        empty_hint=(
            "Every change to tenants, keys, models, prices, nodes and deployments is recorded here."
        ),
    )
    return page.render(request)
