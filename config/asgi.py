"""ASGI entry point: ``/v1/…`` inference goes to the gateway, everything else to Django.

Both run in the same server process (gunicorn + uvicorn workers) behind one port. The
gateway is a bare ASGI application (see gateway/app.py for why); lifespan events start
and stop its caches, Redis connections and upstream HTTP session.
"""

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from core.uploads import BodyLimit  # noqa: E402 - needs Django set up first
from gateway.app import Gateway  # noqa: E402


class Dispatcher:
    """Routes each connection by path; answers lifespan itself (Django does not)."""

    def __init__(self, django_app: Any, gateway: Gateway) -> None:
        self.django = django_app
        self.gateway = gateway

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] == "http" and self.gateway.handles(scope["path"]):
            return await self.gateway(scope, receive, send)
        return await self.django(scope, receive, send)

    async def lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.gateway.startup()
                except Exception as exc:  # noqa: BLE001 - report, so the server refuses to start
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.gateway.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


application = Dispatcher(BodyLimit(django_application), Gateway())
