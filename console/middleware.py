"""A user whose password someone else chose sets their own before anything else opens."""

from collections.abc import Callable

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse

from core.problems import problem
from tenants.services import must_change_password

# Reachable with a one-time password: the page to change it, logging out, and the
# files those pages need.
OPEN_PATHS = ("/password/", "/logout/", "/static/", "/favicon.ico", "/healthz")


class PasswordChangeRequiredMiddleware:
    """Sends a session user with ``must_change_password`` to the password page.

    Requests authenticated by an admin API token carry no session user and pass: a token
    can only have been created after the password was changed.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = request.user
        if (
            user.is_authenticated
            and not request.path.startswith(OPEN_PATHS)
            and must_change_password(user)
        ):
            return self._refuse(request)
        return self.get_response(request)

    @staticmethod
    def _refuse(request: HttpRequest) -> HttpResponse:
        detail = "Set a new password first: the one you signed in with was a one-time password."
        if request.path.startswith("/api/"):
            return problem(request, 403, detail)
        messages.info(request, detail)
        return redirect(reverse("console:password-change"))
