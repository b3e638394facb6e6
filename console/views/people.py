"""People: console users, their tenants and roles.

Platform admins manage every user (invite with a one-time password, deactivate, reset the
password, memberships and roles per tenant) on ``/people/``. Tenant admins manage their own
tenant's members on the tenant's members page (``/tenants/<slug>/members/``); for them
``/people/`` leads there. Members may not manage people (403); another tenant's members
page is 404. Every change goes through ``tenants.services``, as on the admin API.
"""

from typing import Any

import django_filters
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from console.access import require_tenant_admin, staff_required, tenant_or_404
from console.forms import InviteForm, MembershipForm
from console.generic import Action, Column, ListPage, saved, service_action, service_form
from console.templatetags.console import ago, badge
from tenants import services
from tenants.access import admin_tenants
from tenants.choices import Role
from tenants.models import Membership, Tenant

User = get_user_model()


class UserFilter(django_filters.FilterSet):
    username = django_filters.CharFilter(lookup_expr="icontains", label="User name")
    is_active = django_filters.BooleanFilter(label="Active")
    is_staff = django_filters.BooleanFilter(label="Platform admin")

    class Meta:
        model = User
        fields = ["username", "is_active", "is_staff"]


def _roles(user: Any) -> str:
    return (
        "; ".join(f"{m.get_role_display()} of {m.tenant.name}" for m in user.memberships.all())
        or "—"
    )


@login_required
def people(request: HttpRequest) -> HttpResponse:
    if not request.user.is_staff:
        return _tenant_admin_people(request)
    detail = lambda u: reverse("console:user-detail", args=[u.pk])  # noqa: E731
    new = reverse("console:user-new")
    page = ListPage(
        title="People",
        queryset=User.objects.prefetch_related("memberships__tenant"),
        filterset_class=UserFilter,
        default_sort="username",
        nav="people",
        intro="Console users: platform admins, and the admins and members of each tenant.",
        columns=[
            Column("User name", lambda u: u.username, sort="username", href=detail),
            Column("Email", lambda u: u.email, sort="email"),
            Column("Platform admin", lambda u: "yes" if u.is_staff else "no", sort="is_staff"),
            Column(
                "Status",
                lambda u: badge("active" if u.is_active else "disabled", _state(u)),
                sort="is_active",
            ),
            Column("Tenants", _roles),
            Column("Last login", lambda u: ago(u.last_login), sort="last_login"),
        ],
        actions=[Action("New user", new, style="primary")],
        empty_title="No users yet",
        empty_action=Action("Invite the first user", new, style="primary"),
    )
    return page.render(request)


def _state(user: Any) -> str:
    return "active" if user.is_active else "deactivated"


def _tenant_admin_people(request: HttpRequest) -> HttpResponse:
    tenants = list(admin_tenants(request.user))
    if not tenants:
        raise PermissionDenied("Only platform admins and tenant admins can manage people.")
    if len(tenants) == 1:
        return redirect("console:tenant-members", slug=tenants[0].slug)
    return render(request, "console/people/tenants.html", {"tenants": tenants, "nav": "people"})


def _invited(request: HttpRequest, invited: services.InvitedUser, back: str) -> HttpResponse:
    # Rendered, not redirected: the one-time password exists only in this response.
    response = render(
        request,
        "console/people/password.html",
        {
            "person": invited.user,
            "password": invited.password,
            "headline": f"User {invited.user.get_username()} created",
            "back": back,
            "login_url": request.build_absolute_uri(reverse("console:login")),
            "nav": "people",
        },
    )
    response["Cache-Control"] = "no-store"
    return response


@staff_required
def user_new(request: HttpRequest) -> HttpResponse:
    form = InviteForm(request.POST or None, tenants=Tenant.objects.order_by("name"))
    return service_form(
        request,
        form,
        lambda f: services.invite_user(request.user, **f.cleaned_data),
        lambda invited: _invited(
            request, invited, reverse("console:user-detail", args=[invited.user.pk])
        ),
        "New user",
        cancel=reverse("console:people"),
        submit="Create user",
        nav="people",
        intro="Tollgate makes a one-time password, shown once on the next page; the user "
        "sets their own at the first login.",
    )


@staff_required
def user_detail(request: HttpRequest, pk: int) -> HttpResponse:
    person = get_object_or_404(User, pk=pk)
    form = MembershipForm(request.POST or None)
    held = person.memberships.values_list("tenant_id", flat=True)
    form.fields["tenant"].queryset = Tenant.objects.exclude(pk__in=held).order_by("name")
    here = reverse("console:user-detail", args=[pk])
    if request.method == "POST":  # the "add to a tenant" form
        return service_form(
            request,
            form,
            lambda f: services.add_member(
                request.user, f.cleaned_data["tenant"], person, f.cleaned_data["role"]
            ),
            lambda m: saved(
                request,
                f"{person} is now {m.get_role_display().lower()} of {m.tenant.name}.",
                "console:user-detail",
                pk=pk,
            ),
            f"Add {person} to a tenant",
            cancel=here,
            nav="people",
        )
    return render(
        request,
        "console/people/detail.html",
        {
            "person": person,
            "memberships": person.memberships.select_related("tenant"),
            "form": form,
            "roles": Role.choices,
            "actions": _user_actions(request, person),
            "nav": "people",
            "here": here,
        },
    )


def _user_actions(request: HttpRequest, person: Any) -> list[Action]:
    actions = []
    if person.is_active and person.has_usable_password():
        actions.append(
            Action(
                "Reset password",
                reverse("console:user-reset-password", args=[person.pk]),
                method="post",
                confirm=f"Give {person} a new one-time password? Their current one stops working.",
            )
        )
    if person.pk != request.user.pk:
        actions.append(
            Action(
                "Deactivate" if person.is_active else "Activate",
                reverse("console:user-status", args=[person.pk])
                + ("?active=0" if person.is_active else "?active=1"),
                method="post",
                style="danger" if person.is_active else "",
                confirm=f"Deactivate {person}? Their sessions and API tokens stop working."
                if person.is_active
                else "",
            )
        )
    return actions


@staff_required
@require_POST
def user_status(request: HttpRequest, pk: int) -> HttpResponse:
    person = get_object_or_404(User, pk=pk)
    active = request.GET.get("active") == "1"
    return service_action(
        request,
        lambda: services.set_user_active(request.user, person, active),
        f"{person} is {'active again' if active else 'deactivated'}.",
        redirect("console:user-detail", pk=pk),
    )


@staff_required
@require_POST
def user_reset_password(request: HttpRequest, pk: int) -> HttpResponse:
    person = get_object_or_404(User, pk=pk)
    try:
        password = services.reset_password(request.user, person)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("console:user-detail", pk=pk)
    response = render(
        request,
        "console/people/password.html",
        {
            "person": person,
            "password": password,
            "headline": f"New one-time password for {person}",
            "back": reverse("console:user-detail", args=[pk]),
            "login_url": request.build_absolute_uri(reverse("console:login")),
            "nav": "people",
        },
    )
    response["Cache-Control"] = "no-store"
    return response


# --- A tenant's members (tenant admins and platform admins) ----------------------------------


def _managed_tenant(request: HttpRequest, slug: str) -> Tenant:
    tenant = tenant_or_404(request.user, slug)  # another tenant's: 404
    require_tenant_admin(request.user, tenant)  # a member: 403
    return tenant


def _members(tenant: Tenant) -> QuerySet[Membership]:
    return tenant.memberships.select_related("user").order_by("user__username")


@login_required
def tenant_members(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _managed_tenant(request, slug)
    here = reverse("console:tenant-members", args=[slug])
    form = InviteForm(request.POST or None, staff=False)
    return service_form(
        request,
        form,
        lambda f: services.invite_user(request.user, tenant=tenant, **f.cleaned_data),
        lambda invited: _invited(request, invited, here),
        f"Members of {tenant.name}",
        cancel=reverse("console:tenant-detail", args=[slug]),
        submit="Invite",
        nav="people",
        template="console/people/members.html",
        extra=lambda: {
            "tenant": tenant,
            "members": _members(tenant),
            "roles": Role.choices,
            "here": here,
        },
    )


def _back(request: HttpRequest, default: str) -> HttpResponse:
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return redirect(target)
    return redirect(default)


@login_required
@require_POST
def member_role(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    tenant = _managed_tenant(request, slug)
    membership = get_object_or_404(tenant.memberships.select_related("user"), pk=pk)
    role = request.POST.get("role", "")
    label = dict(Role.choices).get(role, role)
    return service_action(
        request,
        lambda: services.change_role(request.user, membership, role),
        f"{membership.user} is now {label.lower()} of {tenant.name}.",
        _back(request, reverse("console:tenant-members", args=[slug])),
    )


@login_required
@require_POST
def member_remove(request: HttpRequest, slug: str, pk: int) -> HttpResponse:
    tenant = _managed_tenant(request, slug)
    membership = get_object_or_404(tenant.memberships.select_related("user"), pk=pk)
    return service_action(
        request,
        lambda: services.remove_member(request.user, membership),
        f"{membership.user} is no longer in {tenant.name}.",
        _back(request, reverse("console:tenant-members", args=[slug])),
    )
