"""The gateway's own HTTP/1.1 client for engines, against small real servers on loopback
whose behaviour each test controls byte for byte (keep-alive, chunking, closing early)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gateway.upstream import EngineClient, UpstreamBroken, UpstreamRefused

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Engine:
    """A loopback server that counts connections and runs ``handler`` for each."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler, self.tls = handler, tls
        self.connections = 0
        self.disconnected = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Engine:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            finally:
                writer.close()
                self.disconnected.set()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    line, *lines = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in lines)}
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return line, headers, body


def json_reply(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
        % (len(body), extra, body)
    )


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            line, headers, body = await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(
            json_reply(
                b'{"line":"%b","host":"%b","id":"%b","len":%d}'
                % (line, headers[b"host"], headers.get(b"x-request-id", b""), len(body))
            )
        )
        await writer.drain()


def test_requests_reuse_one_keep_alive_connection_and_arrive_as_sent() -> None:
    async def scenario() -> tuple[list[bytes], int]:
        async with Engine(echo_forever) as engine:
            client = EngineClient()
            replies = []
            for n in range(5):
                resp = await client.post(
                    f"{engine.url}/v1/chat/completions",
                    data=b"x" * n,
                    headers={"content-type": "application/json", "x-request-id": f"req_{n}"},
                )
                assert resp.status == 200
                replies.append(await resp.read())
                resp.close()
            await client.close()
            return replies, engine.connections

    replies, connections = asyncio.run(scenario())
    assert connections == 1
    port = replies[0].split(b'"host":"127.0.0.1:')[1].split(b'"')[0]
    assert replies[3] == (
        b'{"line":"POST /v1/chat/completions HTTP/1.1","host":"127.0.0.1:%b","id":"req_3","len":3}'
        % port
    )


def test_a_connection_the_engine_closed_while_idle_is_replaced_without_an_error() -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(json_reply(b"{}"))
        await writer.drain()
        await asyncio.sleep(0.05)  # then closes: a keep-alive timeout shorter than the client's

    async def scenario() -> tuple[list[int], int]:
        async with Engine(one_then_close) as engine:
            client = EngineClient(idle_seconds=60)
            statuses = []
            for _ in range(3):
                resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
                statuses.append(resp.status)
                await resp.read()
                resp.close()
                await asyncio.sleep(0.2)
            await client.close()
            return statuses, engine.connections

    statuses, connections = asyncio.run(scenario())
    assert statuses == [200, 200, 200]
    assert connections == 3


def test_a_chunked_stream_is_handed_over_as_it_arrives() -> None:
    release = None

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: "
            b"chunked\r\n\r\n"
        )
        for frame in (b"data: one\n\n", b"data: two\n\n"):
            writer.write(b"%x\r\n%b\r\n" % (len(frame), frame))
            await writer.drain()
            await release.wait()
            release.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def scenario() -> list[bytes]:
        nonlocal release
        release = asyncio.Event()
        async with Engine(stream) as engine:
            client = EngineClient()
            resp = await client.post(engine.url + "/v1/chat/completions", data=b"{}", headers={})
            seen = []
            async for chunk in resp.content.iter_any():
                seen.append(chunk)  # each frame arrives while the engine still holds the next
                release.set()
            resp.close()
            await client.close()
            return seen

    assert asyncio.run(scenario()) == [b"data: one\n\n", b"data: two\n\n"]


def test_a_body_delimited_by_the_end_of_the_connection_is_read_whole() -> None:
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + b"7" * 100_000)
        await writer.drain()

    async def scenario() -> bytes:
        async with Engine(http10) as engine:
            client = EngineClient()
            resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
            body = await resp.read()
            resp.close()
            await client.close()
            return body

    assert asyncio.run(scenario()) == b"7" * 100_000


def test_a_large_body_read_slowly_arrives_intact() -> None:
    payload = bytes(range(256)) * 40_000  # 10 MB, well past the read-pause threshold

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(json_reply(payload))
        await writer.drain()
        await reader.read()

    async def scenario() -> bytes:
        async with Engine(big) as engine:
            client = EngineClient()
            resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
            parts = []
            async for chunk in resp.content.iter_any():
                parts.append(chunk)
                await asyncio.sleep(0.001)
            resp.close()
            await client.close()
            return b"".join(parts)

    assert asyncio.run(scenario()) == payload


def test_closing_a_response_early_drops_the_connection_so_the_engine_sees_the_client_go() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"6\r\ntoken \r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            return

    async def scenario() -> bool:
        async with Engine(endless) as engine:
            client = EngineClient()
            resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
            async for _ in resp.content.iter_any():
                break
            resp.close()
            await asyncio.wait_for(engine.disconnected.wait(), 30)
            await client.close()
            return engine.disconnected.is_set()

    assert asyncio.run(scenario())


def test_an_engine_that_dies_mid_body_raises_instead_of_ending_quietly() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
        await writer.drain()

    async def scenario() -> None:
        async with Engine(dies) as engine:
            client = EngineClient()
            resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
            try:
                await resp.read()
            finally:
                resp.close()
                await client.close()

    with pytest.raises(UpstreamBroken):
        asyncio.run(scenario())


def test_nothing_listening_is_refused_so_another_replica_can_be_tried() -> None:
    async def scenario() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await EngineClient().post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}", headers={})

    with pytest.raises(UpstreamRefused, match="cannot connect"):
        asyncio.run(scenario())


def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async def scenario() -> int:
        async with Engine(echo_forever) as engine:
            with pytest.raises(ValueError, match="line break"):
                await EngineClient().post(
                    engine.url + "/v1/completions",
                    data=b"{}",
                    headers={"authorization": "Bearer k\r\nx-evil: 1"},
                )
            return engine.connections

    assert asyncio.run(scenario()) == 0


def test_https_engines_are_verified_against_the_trusted_certificates(
    tmp_path: Path, monkeypatch
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def call() -> bytes:
        async with Engine(echo_forever, tls=tls) as engine:
            client = EngineClient()
            resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
            body = await resp.read()
            resp.close()
            await client.close()
            return body

    with pytest.raises(UpstreamRefused, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(call())  # a certificate nobody vouched for
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # what an admin's private CA bundle does
    assert b'"line":"POST /v1/completions HTTP/1.1"' in asyncio.run(call())


def test_a_reused_connection_closed_as_the_request_goes_out_is_retried_once_on_a_fresh_one() -> (
    None
):
    async def answers_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(json_reply(b'{"n":1}'))
        await writer.drain()
        await read_request(reader)  # the next request on this connection: closed unanswered

    async def scenario() -> tuple[list[bytes], int]:
        async with Engine(answers_once) as engine:
            client = EngineClient()
            bodies = []
            for _ in range(2):
                resp = await client.post(engine.url + "/v1/completions", data=b"{}", headers={})
                bodies.append(await resp.read())
                resp.close()
            await client.close()
            return bodies, engine.connections

    bodies, connections = asyncio.run(scenario())
    assert bodies == [b'{"n":1}', b'{"n":1}']
    assert connections == 2
