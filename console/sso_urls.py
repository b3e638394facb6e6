"""Single sign-on URLs, under the names mozilla-django-oidc reverses (no namespace)."""

from django.urls import path

from console.sso import SSOCallbackView, SSOLoginView

urlpatterns = [
    path("oidc/authenticate/", SSOLoginView.as_view(), name="oidc_authentication_init"),
    path("oidc/callback/", SSOCallbackView.as_view(), name="oidc_authentication_callback"),
]
