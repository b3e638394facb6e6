"""The policy in front of a fake Docker Engine, both in one background event loop.

A Docker Engine cannot be faked for behaviour, but it can be for what the policy must do
with the bytes it receives and sends: the fake records every request that reaches it (the
policy's forwarded form) and answers enough of the API for the Docker SDK to go on
(containers it creates keep the labels they were given). Streams are driven by the test
(``Harness.release``), so "the first chunk arrived before the second was sent" is an event,
not a timing. Used by the unit tests; the docker stage runs against a real Engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from dockerpolicy.server import start
from dockerpolicy.settings import Settings


@dataclass
class Received:
    """A request as the fake Docker Engine received it."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeDocker:
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    networks: dict[str, dict[str, Any]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop | None = None

    def add_container(self, name: str, labels: dict[str, str]) -> str:
        container_id = uuid.uuid4().hex + uuid.uuid4().hex
        self.containers[container_id] = {
            "Id": container_id,
            "Name": f"/{name}",
            "Config": {"Labels": labels, "Tty": False, "Env": [], "Image": "x"},
            "State": {"Status": "created", "Running": False, "ExitCode": 0},
            "Created": "2026-11-26T00:00:00Z",
            "HostConfig": {},
            "NetworkSettings": {"Ports": {}},
        }
        return container_id

    def find(self, ref: str) -> dict[str, Any] | None:
        for container in self.containers.values():
            if ref in (container["Id"], container["Name"][1:]) or (
                len(ref) >= 12 and container["Id"].startswith(ref)
            ):
                return container
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(
                request.method,
                request.raw_path,
                {k.lower(): v for k, v in request.headers.items()},
                body,
            )
        )
        path = (
            request.path.split("/", 2)[2] if request.path.startswith("/v1.") else request.path[1:]
        )
        parts = path.split("/")
        handler: Callable = getattr(
            self, f"on_{request.method.lower()}_{parts[0].strip('_')}", None
        )
        if handler is None:
            return web.json_response({"message": "page not found"}, status=404)
        return await handler(request, parts, body)

    async def on_get_ping(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        return web.Response(
            text="OK", headers={"Api-Version": "1.41", "Docker-Experimental": "false"}
        )

    on_head_ping = on_get_ping

    async def on_get_version(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        return web.json_response(
            {"ApiVersion": "1.41", "Version": "20.10.24", "GoVersion": "go1.19"}
        )

    async def on_get_info(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        return web.json_response({"ServerVersion": "20.10.24", "MemTotal": 2**34, "NCPU": 2})

    async def on_get_images(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        return web.json_response({"Id": "sha256:" + "0" * 64, "RepoTags": ["/".join(parts[1:-1])]})

    async def on_post_images(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        """A pull: progress lines, each sent only when the test releases it ("pull-<n>")."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if request.query.get("tag") == "broken":  # one line, then the Engine goes away
            await response.write(b'{"status": "Pulling fs layer"}\r\n')
            request.transport.close()
            return response
        for n in range(3):
            await self.gate(f"pull-{n}").wait()
            line = {
                "status": "Downloading",
                "id": "layer",
                "progressDetail": {"current": n, "total": 3},
            }
            await response.write(json.dumps(line).encode() + b"\r\n")
        await response.write_eof()
        return response

    async def on_get_containers(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        if parts[1] == "json":
            return web.json_response(
                [
                    {"Id": c["Id"], "Names": [c["Name"]], "Labels": c["Config"]["Labels"]}
                    for c in self.containers.values()
                ]
            )
        container = self.find(parts[1])
        if container is None:
            return web.json_response({"message": f"No such container: {parts[1]}"}, status=404)
        if parts[2] == "json":
            return web.json_response(container)
        # logs: Docker's multiplexed stream (stdout frames)
        payload = b"line one\nline two\n"
        return web.Response(
            body=b"\x01\x00\x00\x00" + len(payload).to_bytes(4, "big") + payload,
            content_type="application/vnd.docker.raw-stream",
        )

    async def on_post_containers(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        if parts[1] == "create":
            spec = json.loads(body)
            container_id = self.add_container(request.query["name"], spec.get("Labels") or {})
            self.containers[container_id]["Config"].update(spec)
            return web.json_response({"Id": container_id, "Warnings": []}, status=201)
        container = self.find(parts[1])
        if container is None:
            return web.json_response({"message": "No such container"}, status=404)
        if parts[2] == "wait":
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await self.gate("wait").wait()
            await response.write(b'{"StatusCode":0}\n')
            await response.write_eof()
            return response
        container["State"].update(
            Status="running" if parts[2] == "start" else "exited", Running=parts[2] == "start"
        )
        return web.Response(status=204)

    async def on_put_containers(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        """An archive put (the tar is in ``received``)."""
        if self.find(parts[1]) is None:
            return web.json_response({"message": "No such container"}, status=404)
        return web.Response(status=200)

    async def on_delete_containers(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        container = self.find(parts[1])
        if container is None:
            return web.json_response({"message": "No such container"}, status=404)
        del self.containers[container["Id"]]
        return web.Response(status=204)

    async def on_get_networks(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        if len(parts) == 1:
            return web.json_response(list(self.networks.values()))
        for network in self.networks.values():
            if parts[1] in (network["Id"], network["Name"]):
                return web.json_response(network)
        return web.json_response({"message": f"network {parts[1]} not found"}, status=404)

    async def on_post_networks(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        network_id = uuid.uuid4().hex + uuid.uuid4().hex
        self.networks[network_id] = {"Id": network_id, "Name": json.loads(body)["Name"]}
        return web.json_response({"Id": network_id, "Warning": ""}, status=201)

    async def on_get_volumes(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        return web.json_response({"Name": parts[1], "Driver": "local"})

    async def on_post_volumes(
        self, request: web.Request, parts: list[str], body: bytes
    ) -> web.StreamResponse:
        return web.json_response({"Name": json.loads(body)["Name"], "Driver": "local"}, status=201)

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())


class Harness:
    """The fake Engine on a unix socket and the policy on a loopback port, in a thread."""

    def __init__(self, settings: Settings, policy_socket: str = "") -> None:
        self.settings = settings
        self.dir = Path(tempfile.mkdtemp(prefix="tgdp-", dir="/tmp"))
        self.socket_path = str(self.dir / "docker.sock")
        self.policy_socket = policy_socket or self.socket_path  # where the policy finds Docker
        self.docker = FakeDocker()
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runners: list[Any] = []

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    async def _start(self) -> None:
        app = web.Application(client_max_size=8 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self.docker.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, self.socket_path).start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        policy_runner, proxy = await start(
            self.settings, "127.0.0.1", self.port, self.policy_socket
        )
        self.runners = [policy_runner, proxy, runner]

    def release(self, gate: str) -> None:
        self.loop.call_soon_threadsafe(lambda: self.docker.gate(gate).set())

    def stop(self) -> None:
        async def stop() -> None:
            policy_runner, proxy, runner = self.runners
            await policy_runner.cleanup()
            await proxy.close()
            await runner.cleanup()

        if self.runners:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
        Path(self.socket_path).unlink(missing_ok=True)
        self.dir.rmdir()
