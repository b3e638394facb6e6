"""Alerts: console notices, webhook endpoints and the webhook delivery log.

Tenant admins see their tenants' notices, endpoints and deliveries and manage those
endpoints; platform admins see everything and manage platform endpoints (no tenant).
Members get 403 on these pages; another tenant's notice, endpoint or delivery is 404. The
same services and visibility rules as the admin API (alerts.services).
"""

import json
from typing import Any

import django_filters
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from alerts import services
from alerts.choices import DeliveryStatus, Event, Severity
from alerts.models import Notice, WebhookDelivery, WebhookEndpoint
from console.forms import WebhookForm
from console.generic import Action, Column, ListPage, saved, service_action, service_form
from console.templatetags.console import ago, badge
from tenants.access import admin_tenant_ids, admin_tenants

NAV = "alerts"
# How a delivery's state reads, and the badge colour it takes (console.templatetags.badge).
DELIVERY_BADGES = {
    DeliveryStatus.PENDING: "pending",
    DeliveryStatus.SUCCEEDED: "succeeded",
    DeliveryStatus.FAILED: "pending",
    DeliveryStatus.GAVE_UP: "failed",
}
SEVERITY_BADGES = {Severity.INFO: "", Severity.WARNING: "pending", Severity.CRITICAL: "failed"}


def _require_alert_admin(user: Any) -> None:
    if not (user.is_staff or admin_tenant_ids(user)):
        raise PermissionDenied("Only tenant admins and platform admins see alerts and webhooks.")


def _tabs(current: str) -> list[Action]:
    """The three alert pages, as buttons above each list (the current one highlighted)."""
    pages = [
        ("Notices", "console:notice-list"),
        ("Webhooks", "console:webhook-list"),
        ("Delivery log", "console:delivery-list"),
    ]
    return [
        Action(label, reverse(name), style="primary" if name == current else "")
        for label, name in pages
    ]


def _admin_tenants(request: HttpRequest) -> Any:
    """The tenants a filter offers: those the user administers (all for platform admins)."""
    return admin_tenants(request.user)


def _tenant_name(tenant: Any) -> str:
    return tenant.name if tenant is not None else "Platform"


def delivery_badge(row: WebhookDelivery) -> str:
    return badge(DELIVERY_BADGES[row.status], row.get_status_display())


# --- Notices ------------------------------------------------------------------------------


class NoticeFilter(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(
        choices=[("open", "Open"), ("acknowledged", "Acknowledged")],
        method="by_state",
        empty_label="Any state",
        label="State",
    )
    tenant = django_filters.ModelChoiceFilter(
        queryset=_admin_tenants, to_field_name="slug", empty_label="All tenants"
    )
    event = django_filters.ChoiceFilter(choices=Event.choices, empty_label="Any event")
    severity = django_filters.ChoiceFilter(choices=Severity.choices, empty_label="Any severity")

    class Meta:
        model = Notice
        fields = ["state", "tenant", "event", "severity"]

    def by_state(self, queryset: Any, name: str, value: str) -> Any:
        return queryset.filter(acknowledged_at__isnull=value == "open")


@login_required
def notice_list(request: HttpRequest) -> HttpResponse:
    _require_alert_admin(request.user)
    detail = lambda n: reverse("console:notice-detail", args=[n.pk])  # noqa: E731
    page = ListPage(
        title="Notices",
        queryset=services.notices_visible_to(request.user),
        filterset_class=NoticeFilter,
        default_sort="-created_at",
        nav=NAV,
        intro="Alerts for you: budget thresholds crossed"
        + (" and the platform's own (engine drift)" if request.user.is_staff else "")
        + ". Open ones show as a banner on every page until someone acknowledges them.",
        actions=_tabs("console:notice-list"),
        columns=[
            Column("Raised", lambda n: n.created_at.strftime("%Y-%m-%d %H:%M"), sort="created_at"),
            Column(
                "Severity",
                lambda n: badge(SEVERITY_BADGES[n.severity], n.get_severity_display()),
                sort="severity",
            ),
            Column("Alert", lambda n: n.title, href=detail),
            Column("Tenant", lambda n: _tenant_name(n.tenant), sort="tenant__name"),
            Column("Event", lambda n: n.event, sort="event"),
            Column(
                "Acknowledged",
                lambda n: (
                    f"{ago(n.acknowledged_at)} by {n.acknowledged_by or 'someone removed'}"
                    if n.acknowledged_at
                    else badge("pending", "open")
                ),
                sort="acknowledged_at",
            ),
        ],
        empty_title="No notices",
        empty_hint="Budget alerts appear here when a tenant's quota or a key's budget crosses "
        "one of its thresholds (50, 80 and 100 % unless the tenant says otherwise).",
    )
    return page.render(request)


@login_required
def notice_detail(request: HttpRequest, pk: int) -> HttpResponse:
    notice = get_object_or_404(services.notices_visible_to(request.user), pk=pk)
    actions = []
    if not notice.acknowledged:
        url = reverse("console:notice-acknowledge", args=[pk])
        actions.append(Action("Acknowledge", url, method="post", style="primary"))
    deliveries = services.deliveries_visible_to(request.user).filter(notice=notice)
    return render(
        request,
        "console/alerts/notice_detail.html",
        {
            "notice": notice,
            "nav": NAV,
            "actions": actions,
            "payload": json.dumps(notice.payload, indent=2, sort_keys=True),
            "deliveries": [(d, delivery_badge(d)) for d in deliveries.order_by("-created_at")],
        },
    )


@login_required
@require_POST
def notice_acknowledge(request: HttpRequest, pk: int) -> HttpResponse:
    notice = get_object_or_404(services.notices_visible_to(request.user), pk=pk)
    services.acknowledge(request.user, notice)
    messages.success(request, f"Acknowledged: {notice.title}.")
    back = request.POST.get("next") or ""
    if back and url_has_allowed_host_and_scheme(back, {request.get_host()}, request.is_secure()):
        return redirect(back)
    return redirect("console:notice-detail", pk=pk)


# --- Webhook endpoints ---------------------------------------------------------------------


class WebhookFilter(django_filters.FilterSet):
    tenant = django_filters.ModelChoiceFilter(
        queryset=_admin_tenants, to_field_name="slug", empty_label="All tenants"
    )
    enabled = django_filters.BooleanFilter(label="Enabled")

    class Meta:
        model = WebhookEndpoint
        fields = ["tenant", "enabled"]


@login_required
def webhook_list(request: HttpRequest) -> HttpResponse:
    _require_alert_admin(request.user)
    detail = lambda e: reverse("console:webhook-detail", args=[e.pk])  # noqa: E731
    new = reverse("console:webhook-new")
    page = ListPage(
        title="Webhooks",
        queryset=services.endpoints_visible_to(request.user),
        filterset_class=WebhookFilter,
        default_sort="-created_at",
        nav=NAV,
        intro="Tollgate POSTs each alert, signed with the endpoint's secret, to every enabled "
        "endpoint subscribed to its event.",
        actions=[*_tabs("console:webhook-list"), Action("New endpoint", new, style="primary")],
        columns=[
            Column("Endpoint", lambda e: e.description or e.url, href=detail),
            Column("URL", lambda e: e.url, sort="url"),
            Column("Tenant", lambda e: _tenant_name(e.tenant), sort="tenant__name"),
            Column("Events", lambda e: ", ".join(e.events)),
            Column(
                "State",
                lambda e: badge("active", "enabled") if e.enabled else badge("disabled"),
                sort="enabled",
            ),
            Column("Created", lambda e: e.created_at.strftime("%Y-%m-%d %H:%M"), sort="created_at"),
        ],
        empty_title="No webhook endpoints yet",
        empty_hint="Add one to receive budget alerts in your own tools (a chat bridge, an "
        "incident tool). Its signing secret is shown once.",
        empty_action=Action("Add an endpoint", new, style="primary"),
    )
    return page.render(request)


def _visible_endpoint(request: HttpRequest, pk: int) -> WebhookEndpoint:
    return get_object_or_404(services.endpoints_visible_to(request.user), pk=pk)


def _managed_endpoint(request: HttpRequest, pk: int) -> WebhookEndpoint:
    endpoint = _visible_endpoint(request, pk)
    if not services.may_manage(request.user, endpoint.tenant):
        raise PermissionDenied("Only admins of the endpoint's tenant can change it.")
    return endpoint


def _secret_page(request: HttpRequest, issued: services.IssuedEndpoint, verb: str) -> HttpResponse:
    # Rendered, not redirected: the secret exists only in this response.
    response = render(
        request,
        "console/alerts/webhook_secret.html",
        {"endpoint": issued.endpoint, "secret": issued.secret, "verb": verb, "nav": NAV},
    )
    response["Cache-Control"] = "no-store"
    return response


def _create(request: HttpRequest, form: WebhookForm) -> services.IssuedEndpoint:
    tenant = form.cleaned_data.get("tenant")
    if not services.may_manage(request.user, tenant):
        raise PermissionDenied("Only platform admins make platform endpoints.")
    return services.create_endpoint(request.user, tenant, **form.service_data())


@login_required
def webhook_new(request: HttpRequest) -> HttpResponse:
    _require_alert_admin(request.user)
    tenants = admin_tenants(request.user)
    initial = {}
    if request.GET.get("tenant"):
        initial["tenant"] = tenants.filter(slug=request.GET["tenant"]).first()
    form = WebhookForm(
        request.POST or None, initial=initial, tenants=tenants, platform=request.user.is_staff
    )
    return service_form(
        request,
        form,
        lambda f: _create(request, f),
        lambda issued: _secret_page(request, issued, "made"),
        "New webhook endpoint",
        cancel=reverse("console:webhook-list"),
        submit="Make endpoint",
        nav=NAV,
        intro="The signing secret is shown once, right after you make the endpoint.",
    )


@login_required
def webhook_detail(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = _visible_endpoint(request, pk)
    actions = []
    if services.may_manage(request.user, endpoint.tenant):
        actions = [
            Action("Edit", reverse("console:webhook-edit", args=[pk])),
            Action("Send test event", reverse("console:webhook-test", args=[pk]), method="post"),
            Action(
                "Rotate secret",
                reverse("console:webhook-rotate", args=[pk]),
                method="post",
                confirm="Make a new signing secret? The old one stops signing at once: update "
                "the receiver with the new secret.",
            ),
            Action(
                "Delete",
                reverse("console:webhook-delete", args=[pk]),
                method="post",
                style="danger",
                confirm="Delete this endpoint and its delivery log?",
            ),
        ]
    recent = endpoint.deliveries.order_by("-created_at")[:10]
    return render(
        request,
        "console/alerts/webhook_detail.html",
        {
            "endpoint": endpoint,
            "nav": NAV,
            "actions": actions,
            "deliveries": [(d, delivery_badge(d)) for d in recent],
            "log_url": reverse("console:delivery-list") + f"?endpoint={pk}",
        },
    )


@login_required
def webhook_edit(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = _managed_endpoint(request, pk)
    initial = {f: getattr(endpoint, f) for f in ("url", "description", "events", "enabled")}
    form = WebhookForm(
        request.POST or None,
        initial=initial,
        tenants=admin_tenants(request.user),
        platform=request.user.is_staff,
        editing=True,
    )
    return service_form(
        request,
        form,
        lambda f: services.update_endpoint(request.user, endpoint, **f.service_data()),
        lambda _: saved(request, "Endpoint saved.", "console:webhook-detail", pk=pk),
        f"Edit endpoint {endpoint}",
        cancel=reverse("console:webhook-detail", args=[pk]),
        nav=NAV,
    )


@login_required
@require_POST
def webhook_rotate(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = _managed_endpoint(request, pk)
    return _secret_page(request, services.rotate_secret(request.user, endpoint), "rotated")


@login_required
@require_POST
def webhook_test(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = _managed_endpoint(request, pk)
    return service_action(
        request,
        lambda: services.send_test(request.user, endpoint),
        "Test event queued; its delivery shows below within seconds.",
        redirect("console:webhook-detail", pk=pk),
    )


@login_required
@require_POST
def webhook_delete(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = _managed_endpoint(request, pk)
    name = str(endpoint)
    services.delete_endpoint(request.user, endpoint)
    messages.success(request, f"Endpoint {name} deleted.")
    return redirect("console:webhook-list")


# --- The delivery log ------------------------------------------------------------------------


class DeliveryFilter(django_filters.FilterSet):
    status = django_filters.ChoiceFilter(choices=DeliveryStatus.choices, empty_label="Any status")
    event = django_filters.ChoiceFilter(choices=Event.choices, empty_label="Any event")
    endpoint = django_filters.ModelChoiceFilter(
        queryset=WebhookEndpoint.objects.none(), empty_label="All endpoints"
    )
    tenant = django_filters.ModelChoiceFilter(
        field_name="endpoint__tenant",
        queryset=_admin_tenants,
        to_field_name="slug",
        empty_label="All tenants",
    )

    class Meta:
        model = WebhookDelivery
        fields = ["status", "event", "endpoint", "tenant"]

    def __init__(self, *args: object, request: HttpRequest, **kwargs: object) -> None:
        super().__init__(*args, request=request, **kwargs)
        self.filters["endpoint"].queryset = services.endpoints_visible_to(request.user)


@login_required
def delivery_list(request: HttpRequest) -> HttpResponse:
    _require_alert_admin(request.user)
    detail = lambda d: reverse("console:delivery-detail", args=[d.pk])  # noqa: E731
    endpoint = lambda d: reverse("console:webhook-detail", args=[d.endpoint_id])  # noqa: E731
    page = ListPage(
        title="Webhook delivery log",
        queryset=services.deliveries_visible_to(request.user),
        filterset_class=DeliveryFilter,
        default_sort="-created_at",
        nav=NAV,
        intro="Every event sent to an endpoint: a 2xx answer is success; anything else is "
        "retried after 30 s, 2 min, 10 min, 1 h and 6 h, then given up.",
        actions=_tabs("console:delivery-list"),
        columns=[
            Column(
                "Queued",
                lambda d: d.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                href=detail,
                sort="created_at",
            ),
            Column("Event", lambda d: d.event, sort="event"),
            Column("Endpoint", lambda d: str(d.endpoint), href=endpoint),
            Column("Status", delivery_badge, sort="status"),
            Column("HTTP", lambda d: d.response_code, sort="response_code", numeric=True),
            Column("Attempts", lambda d: d.attempts, sort="attempts", numeric=True),
            Column(
                "Next retry",
                lambda d: (
                    d.next_attempt_at.strftime("%Y-%m-%d %H:%M:%S")
                    if d.status == DeliveryStatus.FAILED and d.next_attempt_at
                    else None
                ),
                sort="next_attempt_at",
            ),
            Column("Error", lambda d: d.error[:80]),
        ],
        empty_title="No deliveries yet",
        empty_hint="Deliveries appear here when an alert is sent to an endpoint, or when you "
        "send a test event from an endpoint's page.",
    )
    return page.render(request)


def _visible_delivery(request: HttpRequest, pk: Any) -> WebhookDelivery:
    return get_object_or_404(services.deliveries_visible_to(request.user), pk=pk)


@login_required
def delivery_detail(request: HttpRequest, pk: Any) -> HttpResponse:
    row = _visible_delivery(request, pk)
    actions = []
    retryable = row.status in (DeliveryStatus.FAILED, DeliveryStatus.GAVE_UP)
    if retryable and services.may_manage(request.user, row.endpoint.tenant):
        url = reverse("console:delivery-retry", args=[row.pk])
        actions.append(Action("Retry now", url, method="post", style="primary"))
    return render(
        request,
        "console/alerts/delivery_detail.html",
        {
            "row": row,
            "nav": NAV,
            "actions": actions,
            "status_badge": delivery_badge(row),
            "payload": json.dumps(row.payload, indent=2, sort_keys=True),
        },
    )


@login_required
@require_POST
def delivery_retry(request: HttpRequest, pk: Any) -> HttpResponse:
    row = _visible_delivery(request, pk)
    if not services.may_manage(request.user, row.endpoint.tenant):
        raise PermissionDenied("Only admins of the endpoint's tenant can retry its deliveries.")
    return service_action(
        request,
        lambda: services.retry_now(request.user, row),
        "Retrying now; the outcome shows here within seconds.",
        redirect("console:delivery-detail", pk=row.pk),
    )
