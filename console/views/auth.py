"""Login (throttled by django-axes), logout, password change, and the home redirect."""

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse_lazy

from tenants import services
from tenants.access import tenants_of


class LoginForm(AuthenticationForm):
    """Django's login form; with single sign-on as the only way in, a local password opens
    only the break-glass admin's account."""

    def clean(self) -> dict:
        if not services.password_login_allowed(self.cleaned_data.get("username", "")):
            raise ValidationError(
                "Local passwords are turned off: use single sign-on.", code="sso_only"
            )
        return super().clean()


class LoginView(auth_views.LoginView):
    template_name = "console/login.html"
    redirect_authenticated_user = True
    authentication_form = LoginForm

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        return {
            **super().get_context_data(**kwargs),
            "sso": settings.TOLLGATE_SSO_ENABLED,
            "sso_only": settings.TOLLGATE_SSO_ENABLED and settings.TOLLGATE_SSO_ONLY,
            "sso_label": settings.TOLLGATE_OIDC_BUTTON_LABEL,
        }


class LogoutView(auth_views.LogoutView):
    """POST only (Django's default): a link cannot log anyone out."""


class PasswordChangeView(auth_views.PasswordChangeView):
    template_name = "console/password_change.html"
    success_url = reverse_lazy("console:home")

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.user.is_authenticated and not request.user.has_usable_password():
            # Single sign-on users have no Tollgate password to change.
            messages.info(
                request, "You sign in with single sign-on; your provider keeps your password."
            )
            return redirect("console:profile")
        return super().dispatch(request, *args, **kwargs)

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        forced = services.must_change_password(self.request.user)
        return {**super().get_context_data(**kwargs), "forced": forced}

    def form_valid(self, form: object) -> HttpResponse:
        response = super().form_valid(form)
        services.password_changed(self.request.user)
        messages.success(self.request, "Your password was changed.")
        return response


@login_required
def home(request: HttpRequest) -> HttpResponse:
    """Platform admins land on the dashboard; tenant users on their tenant."""
    if request.user.is_staff:
        return redirect("console:dashboard")
    tenants = list(tenants_of(request.user)[:2])
    if len(tenants) == 1:
        return redirect("console:tenant-detail", slug=tenants[0].slug)
    return redirect("console:tenant-list")
