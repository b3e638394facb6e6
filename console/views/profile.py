"""Your profile: who you are, your password, and your personal admin API tokens.

Tokens are the admin API's (``tenants.services.issue_admin_token``): shown once, stored as
a prefix and an HMAC hash, listed here, revoked here. A token acts as its user, with that
user's rights, never more.
"""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from console.forms import AdminTokenForm
from console.generic import service_action, service_form
from tenants import services
from tenants.models import AdminToken


def token_status(token: AdminToken) -> str:
    if token.revoked_at:
        return "revoked"
    if token.expires_at and token.expires_at <= timezone.now():
        return "expired"
    return "active"


@login_required
def profile(request: HttpRequest) -> HttpResponse:
    tokens = list(AdminToken.objects.filter(user=request.user))
    for token in tokens:
        token.state = token_status(token)
    return render(
        request,
        "console/profile/page.html",
        {
            "nav": "profile",
            "tokens": tokens,
            "memberships": request.user.memberships.select_related("tenant"),
            "form": AdminTokenForm(),
            "sso": bool(
                getattr(request.user, "account", None) and request.user.account.sso_subject
            ),
        },
    )


def _token_created(request: HttpRequest, issued: services.IssuedToken) -> HttpResponse:
    # Rendered, not redirected: the plaintext exists only in this response.
    response = render(
        request,
        "console/profile/token_created.html",
        {
            "nav": "profile",
            "token": issued.token,
            "plaintext": issued.plaintext,
            "api_url": request.build_absolute_uri("/api/v1/"),
        },
    )
    response["Cache-Control"] = "no-store"
    return response


@login_required
def token_new(request: HttpRequest) -> HttpResponse:
    return service_form(
        request,
        AdminTokenForm(request.POST or None),
        lambda f: services.issue_admin_token(request.user, **f.service_data()),
        lambda issued: _token_created(request, issued),
        "New API token",
        cancel=reverse("console:profile"),
        submit="Create token",
        nav="profile",
    )


@login_required
@require_POST
def token_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    # Only your own tokens: anyone else's answers 404, as if it did not exist.
    token = get_object_or_404(AdminToken, pk=pk, user=request.user)
    return service_action(
        request,
        lambda: services.revoke_admin_token(request.user, token),
        f"Token {token.name} revoked; it stops working at once.",
        redirect("console:profile"),
    )
