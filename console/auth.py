"""Login throttling for the console (django-axes), tolerant of request-less callers."""

from typing import Any

from axes.backends import AxesStandaloneBackend
from django.http import HttpRequest


class LoginThrottleBackend(AxesStandaloneBackend):
    """Refuses logins of a locked-out username/address pair; lets request-less calls pass.

    ``authenticate()`` without a request (management commands, scripts, tests calling it
    directly) has no address an attacker controls, so there is nothing to throttle; axes'
    own backend would raise instead.
    """

    def authenticate(self, request: HttpRequest | None, *args: Any, **kwargs: Any) -> None:
        if request is None:
            return None
        return super().authenticate(request, *args, **kwargs)
