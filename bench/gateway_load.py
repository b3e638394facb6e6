"""The load generator of bench/gateway_bench.py: a separate process with an aiohttp client.

It reads one JSON scenario per line on stdin and answers one JSON result per line on
stdout, so the orchestrator can read the gateway's CPU time right before and after each
scenario without counting this process's start-up. Closed loop: ``concurrency`` workers
each send a request, wait for the whole answer, send the next, until ``requests`` are done
or ``duration`` seconds have passed. Per request it records the latency, the time to the
first content chunk (streams) and the completion tokens received.

Scenario fields: url, key, model, stream, tokens, concurrency, requests, duration; ``api``:
``chat`` (default, /v1/chat/completions), ``responses`` (/v1/responses) or ``messages`` (the
Anthropic Messages API, /v1/messages, with the key in ``x-api-key`` as the anthropic SDK sends
it); ``raw``: also answer every latency and TTFT (ms). ``{"reset": true}`` closes the
connections, so the next scenario opens fresh ones.
"""

from __future__ import annotations

import asyncio
import re
import resource
import ssl
import sys
import time

import aiohttp
import orjson

# Per API: the first frame that carries text (chat: '"content":"' followed by anything but
# the closing quote), the generated tokens in a usage object, the frame of an error.
CONTENT = {
    "chat": re.compile(rb'"content":\s*"[^"]'),
    "responses": re.compile(rb"response\.output_text\.delta"),
    "messages": re.compile(rb'"text_delta","text":\s*"[^"]'),
}
USAGE_TOKENS = {
    "chat": re.compile(rb'"completion_tokens":\s*(\d+)'),
    "responses": re.compile(rb'"output_tokens":\s*(\d+)'),
    "messages": re.compile(rb'"output_tokens":\s*(\d+)'),
}
ERROR_FRAME = {
    "chat": re.compile(rb'"error"'),
    "responses": re.compile(rb"^event: error"),
    "messages": re.compile(rb"^event: error"),
}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def request_body(spec: dict) -> bytes:
    """What a client of the scenario's API sends."""
    api, stream = spec.get("api", "chat"), spec["stream"]
    if api == "responses":
        # Kept (store defaults to true), as the SDK's default: the gateway pays for keeping it.
        payload = {
            "model": spec["model"],
            "input": "Say something.",
            "max_output_tokens": spec["tokens"],
            "stream": stream,
        }
        return orjson.dumps(payload)
    if api == "messages":
        payload = {
            "model": spec["model"],
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": spec["tokens"],
            "stream": stream,
        }
        return orjson.dumps(payload)
    payload = {
        "model": spec["model"],
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": spec["tokens"],
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return orjson.dumps(payload)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Run:
    """Counters of one scenario."""

    def __init__(self) -> None:
        self.latency: list[float] = []
        self.ttft: list[float] = []
        self.tokens = 0
        self.frames = 0
        self.errors = 0
        self.first_error = ""
        self.started_streams = 0


async def one_whole(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict, run: Run, api: str
) -> None:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as r:
        raw = await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {raw[:200]!r}")
    run.latency.append(time.perf_counter() - t0)
    m = USAGE_TOKENS[api].search(raw)
    run.tokens += int(m.group(1)) if m else 0


async def one_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict, run: Run, api: str
) -> None:
    t0 = time.perf_counter()
    first = None
    frames = 0
    usage = 0
    buffer = b""
    async with session.post(url, data=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        async for chunk in r.content.iter_any():
            buffer += chunk
            if first is None and CONTENT[api].search(buffer):
                first = time.perf_counter()
                run.started_streams += 1
            *done, buffer = buffer.split(b"\n\n")
            for frame in done:
                if not frame:
                    continue
                frames += 1
                if b'"usage"' in frame:
                    m = USAGE_TOKENS[api].search(frame)
                    if m:
                        usage = int(m.group(1))
                if ERROR_FRAME[api].search(frame):
                    raise RuntimeError(f"error frame: {frame[:200]!r}")
    if first is None:
        raise RuntimeError("stream ended without a content chunk")
    run.latency.append(time.perf_counter() - t0)
    run.ttft.append(first - t0)
    run.frames += frames
    run.tokens += usage


async def scenario(session: aiohttp.ClientSession, spec: dict) -> dict:
    stream, api = spec["stream"], spec.get("api", "chat")
    body = request_body(spec)
    headers = {"content-type": "application/json"}
    if api == "messages":
        headers["anthropic-version"] = "2023-06-01"
    if spec.get("key") and api == "messages":
        headers["x-api-key"] = spec["key"]
    elif spec.get("key"):
        headers["authorization"] = f"Bearer {spec['key']}"
    url = spec["url"].rstrip("/") + PATHS[api]
    one = one_stream if stream else one_whole
    run = Run()
    left = spec["requests"]
    deadline = time.perf_counter() + spec["duration"]

    async def worker() -> None:
        nonlocal left
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            try:
                await one(session, url, body, headers, run, api)
            except Exception as exc:  # noqa: BLE001 - count it and go on
                run.errors += 1
                if not run.first_error:
                    run.first_error = f"{exc.__class__.__name__}: {exc}"[:300]

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
    secs = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    done = len(run.latency)
    ms = 1000.0
    return {
        "requests": done,
        "errors": run.errors,
        "first_error": run.first_error,
        "seconds": secs,
        "rps": done / secs,
        "tok_s": run.tokens / secs,
        "tokens": run.tokens,
        "frames": run.frames,
        "lat_p50": percentile(run.latency, 0.5) * ms if done else None,
        "lat_p99": percentile(run.latency, 0.99) * ms if done else None,
        "ttft_p50": percentile(run.ttft, 0.5) * ms if run.ttft else None,
        "ttft_p99": percentile(run.ttft, 0.99) * ms if run.ttft else None,
        "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        **(
            {"lat_all": [x * ms for x in run.latency], "ttft_all": [x * ms for x in run.ttft]}
            if spec.get("raw")
            else {}
        ),
    }


async def main() -> None:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        print(orjson.dumps({"ready": True}).decode(), flush=True)
        while line := await reader.readline():
            spec = orjson.loads(line)
            if spec.get("reset"):  # fresh connections for the next server
                await session.close()
                # Behind the TLS front: trust exactly its CA, as a pinned client does.
                tls = ssl.create_default_context(cafile=spec["ca"]) if spec.get("ca") else True
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ssl=tls)
                session = aiohttp.ClientSession(connector=connector, timeout=timeout)
                print(orjson.dumps({"reset": True}).decode(), flush=True)
                continue
            result = await scenario(session, spec)
            print(orjson.dumps(result).decode(), flush=True)
        await session.close()


if __name__ == "__main__":
    try:
        import uvloop  # the client's own cost stays small: more of the 2 cores go to the servers

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
