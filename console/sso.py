"""The console's single sign-on pages: off to the provider, back with a session or a page
saying why not. The rules (discovery, roles from groups, the backend) are tenants/sso.py."""

import logging
from typing import Any

import requests
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from tenants.sso import oidc_setting

log = logging.getLogger(__name__)


class SSOLoginView(OIDCAuthenticationRequestView):
    """Sends the browser to the provider (with state, nonce and a PKCE challenge)."""

    get_settings = staticmethod(oidc_setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)

    def get(self, request: HttpRequest) -> HttpResponse:
        if not settings.TOLLGATE_SSO_ENABLED:
            return refused(request, "Single sign-on is not set up on this appliance.", 404)
        try:
            self.OIDC_OP_AUTH_ENDPOINT = oidc_setting("OIDC_OP_AUTHORIZATION_ENDPOINT")
        except (requests.RequestException, ValueError) as exc:
            # Nothing to forget: a discovery that failed was never cached (lru_cache).
            log.warning("sso: discovery at %s failed: %s", settings.TOLLGATE_OIDC_ISSUER, exc)
            return refused(request, "The single sign-on provider cannot be reached.", 502)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        return super().get(request)


class SSOCallbackView(OIDCAuthenticationCallbackView):
    """The provider's answer: a session, or a page saying why not."""

    def login_failure(self) -> HttpResponse:
        reason = getattr(self.request, "sso_refusal", "")
        if reason:
            return refused(self.request, reason)
        return refused(self.request, "Single sign-on did not complete; please try again.")


def refused(request: HttpRequest, reason: str, status: int = 403) -> HttpResponse:
    return render(request, "console/sso_refused.html", {"reason": reason}, status=status)
