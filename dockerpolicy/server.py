"""The proxy process: receive, decide (``rules.decide``), check ownership, forward, stream.

What reaches Docker is always built here from the decision: method, canonical target,
canonical body, and only the headers Docker needs (the JSON content type, a pull's
``X-Registry-Auth``). Answers stream back as they arrive (pull progress, logs, wait), with
nothing buffered; an archive put (an uploaded adapter) streams the other way, its tar
checked as it is forwarded (``dockerpolicy.tarstream``). One log line per refusal, with the
reason; with ``TOLLGATE_DOCKER_POLICY_LOG=all`` one line per allowed call too. Environment
values, bodies and registry credentials are never logged.
"""

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, UnixConnector, web
from yarl import URL

from dockerpolicy.checks import LABEL_MANAGED, LABEL_STACK
from dockerpolicy.rules import MAX_BODY, Call, Forward, Refuse, decide, streams_body
from dockerpolicy.settings import Settings
from dockerpolicy.tarstream import TarRefused, checked_tar

log = logging.getLogger("dockerpolicy")

# Per-connection headers are the proxy's own business on each side.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "upgrade",
        "te",
        "trailer",
        "proxy-authenticate",
        "proxy-authorization",
        "content-length",
    }
)
_FULL_ID = re.compile(r"[0-9a-f]{64}", re.ASCII)
LABEL_ROLE, HELPER_ROLE = "tollgate.role", "stage"
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def printable(text: str, limit: int = 300) -> str:
    """Client-supplied text made safe for one log line."""
    return _UNPRINTABLE.sub("?", text[:limit])


class Proxy:
    """Decides and forwards calls to the Docker Engine at ``socket_path``."""

    def __init__(self, settings: Settings, socket_path: str) -> None:
        self.settings, self.socket_path = settings, socket_path
        self.session: ClientSession | None = None

    async def open(self) -> None:
        self.session = ClientSession(
            connector=UnixConnector(path=self.socket_path, limit=64),
            timeout=ClientTimeout(total=None, sock_connect=10),  # pulls and waits take long
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.monotonic()
        # An archive is checked as it streams to Docker, never read whole first.
        streamed = streams_body(request.method, request.raw_path)
        body = b"" if streamed else await read_body(request)
        call = Call(
            request.method,
            request.raw_path,
            {name.lower(): value for name, value in request.headers.items()},
            body,
        )
        decision = decide(call, self.settings)
        if isinstance(decision, Refuse):
            return self.refuse(request, decision.reason)
        if bool(decision.tar_under) != streamed:
            return self.refuse(request, "an archive must be sent as the body of its own call")
        try:
            return await self.carry_out(request, decision, started)
        except ClientError as exc:
            log.error(
                "Docker unreachable for %s %s: %s", request.method, printable(request.raw_path), exc
            )
            return error(502, f"the Docker Engine is unreachable: {exc}")

    async def carry_out(
        self, request: web.BaseRequest, decision: Forward, started: float
    ) -> web.StreamResponse:
        container_id = ""
        if decision.owner:
            status, data, headers = await self.inspect(decision)
            if status == 200:
                refusal, container_id = self.ownership(decision, data)
                if refusal:
                    return self.refuse(request, refusal)
            if status != 200 or decision.inspect_is_answer:
                self.allowed(request, status, started)
                return web.Response(status=status, body=data, headers=headers)
        return await self.forward(request, decision, container_id, started)

    async def inspect(self, decision: Forward) -> tuple[int, bytes, dict[str, str]]:
        """The owner's inspect answer (status, body, headers to pass on)."""
        prefix = decision.path.split(f"/{decision.owner_kind}s/", 1)[0]
        suffix = "/json" if decision.owner_kind == "container" else ""
        url = URL(
            f"http://docker{prefix}/{decision.owner_kind}s/{decision.owner}{suffix}", encoded=True
        )
        async with self.session.get(url) as upstream:
            data = await upstream.read()
            return upstream.status, data, passable(upstream.headers)

    def ownership(self, decision: Forward, data: bytes) -> tuple[str, str]:
        """("", full id) when the container (network) is this stack's, else (reason, "")."""
        try:
            info = json.loads(data)
            owned = (
                self.owned_container(info)
                if decision.owner_kind == "container"
                else info["Name"] in self.settings.networks
            )
            full_id = info["Id"]
        except (ValueError, AttributeError, KeyError, TypeError):
            return "Docker's inspect answer could not be read", ""
        if not owned:
            return (
                f"the {decision.owner_kind} {decision.owner!r} is not Tollgate's (not "
                + (
                    f"labelled {LABEL_MANAGED}=true and {LABEL_STACK}={self.settings.stack})"
                    if decision.owner_kind == "container"
                    else "the engine network)"
                )
            ), ""
        if not isinstance(full_id, str) or not _FULL_ID.fullmatch(full_id):
            return "Docker's inspect answer has no id", ""
        if decision.tar_under:
            refusal = self.not_a_fresh_helper(info)
            if refusal:
                return refusal, ""
        return "", full_id

    def not_a_fresh_helper(self, info: dict[str, Any]) -> str:
        """Why files may not be put into this container ("" when they may): only into a
        staging helper that was created and never started, never into an engine."""
        labels = (info.get("Config") or {}).get("Labels") or {}
        if labels.get(LABEL_ROLE) != HELPER_ROLE:
            return f"archives may be put only into helper containers ({LABEL_ROLE}={HELPER_ROLE})"
        if (info.get("State") or {}).get("Status") != "created":
            return "archives may be put only into a helper that was never started"
        return ""

    def owned_container(self, info: dict[str, Any]) -> bool:
        labels = (info.get("Config") or {}).get("Labels") or {}
        return (
            labels.get(LABEL_MANAGED) == "true" and labels.get(LABEL_STACK) == self.settings.stack
        )

    async def forward(
        self, request: web.BaseRequest, decision: Forward, container_id: str, started: float
    ) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"} if decision.body is not None else {}
        if decision.registry_auth:
            headers["X-Registry-Auth"] = decision.registry_auth
        url = URL("http://docker" + decision.target(container_id), encoded=True)
        data: Any = decision.body
        refused: list[str] = []
        if decision.tar_under:
            headers["Content-Type"] = "application/x-tar"
            data = guarded(checked_tar(request.content.read, decision.tar_under), refused)
        try:
            return await self.relay(request, decision, url, data, headers, started)
        except ClientError:
            # aiohttp reports a body that stopped as a connection error: say why it stopped.
            if refused:
                return self.refuse(request, f"the archive: {refused[0]}")
            raise

    async def relay(
        self,
        request: web.BaseRequest,
        decision: Forward,
        url: URL,
        data: Any,
        headers: dict[str, str],
        started: float,
    ) -> web.StreamResponse:
        async with self.session.request(
            decision.method, url, data=data, headers=headers
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status, reason=upstream.reason, headers=passable(upstream.headers)
            )
            if upstream.content_length is not None and request.method != "HEAD":
                response.content_length = upstream.content_length
            await response.prepare(request)
            self.allowed(request, upstream.status, started)
            if request.method != "HEAD":
                try:
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                except ClientError as exc:
                    # The status is sent already: cut the client off rather than end the
                    # stream cleanly, so it cannot mistake a broken pull for a finished one.
                    log.error(
                        "Docker's answer to %s %s broke off: %s",
                        request.method,
                        printable(request.raw_path),
                        exc,
                    )
                    raise ConnectionResetError("Docker's answer broke off") from exc
            await response.write_eof()
            return response

    def refuse(self, request: web.BaseRequest, reason: str) -> web.Response:
        log.warning(
            "refused %s %s from %s (%s): %s",
            request.method,
            printable(request.raw_path),
            request.remote,
            printable(request.headers.get("User-Agent", "-"), 60),
            reason,
        )
        return error(403, f"refused by Tollgate's Docker policy: {reason}")

    def allowed(self, request: web.BaseRequest, status: int, started: float) -> None:
        if self.settings.log_allowed:
            log.info(
                "allowed %s %s from %s (%s): %d after %.1f ms",
                request.method,
                printable(request.raw_path),
                request.remote,
                printable(request.headers.get("User-Agent", "-"), 60),
                status,
                1000 * (time.monotonic() - started),
            )


async def read_body(request: web.BaseRequest) -> bytes:
    """The request body, cut at one byte more than the policy accepts."""
    chunks, size = [], 0
    while size <= MAX_BODY:
        chunk = await request.content.read(MAX_BODY + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def guarded(chunks: AsyncIterator[bytes], refused: list[str]) -> AsyncIterator[bytes]:
    """``chunks``, noting in ``refused`` why they stopped when the check refused the rest."""
    try:
        async for chunk in chunks:
            yield chunk
    except TarRefused as exc:
        refused.append(str(exc))
        raise


def passable(headers: Any) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in _HOP_BY_HOP}


def error(status: int, message: str) -> web.Response:
    """An answer shaped like Docker's own errors, which the Docker SDK shows as they are."""
    return web.json_response({"message": message}, status=status)


async def start(
    settings: Settings, host: str, port: int, socket_path: str
) -> tuple[web.BaseRunner, Proxy]:
    """Serve on ``host:port`` until the runner is cleaned up (and the proxy closed)."""
    proxy = Proxy(settings, socket_path)
    await proxy.open()
    runner = web.ServerRunner(web.Server(proxy.handle, handler_cancellation=True, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=256).start()
    return runner, proxy


async def serve(
    settings: Settings, host: str, port: int, socket_path: str, stop: asyncio.Event
) -> None:
    runner, proxy = await start(settings, host, port, socket_path)
    log.info(
        "listening on %s:%d for the Docker Engine at %s; stack %s; images %s; volumes %s; "
        "networks %s; host network %s",
        host,
        port,
        socket_path,
        settings.stack,
        ", ".join(settings.images),
        ", ".join(sorted(settings.volumes)),
        ", ".join(sorted(settings.networks)),
        "allowed" if settings.allow_host_network else "refused",
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await proxy.close()
