"""The load generator of bench/admission_bench.py: a separate process with an aiohttp client.

Reads one JSON scenario per line on stdin, answers one JSON result per line on stdout.
A scenario is a duration and a list of groups, all started together; each group is one
tenant's traffic:

- ``rate``: open loop, one request every ``1/rate`` seconds (a steady interactive user),
  ``count`` requests in all (or until the duration ends);
- ``concurrency``: closed loop, that many clients each sending back-to-back until the
  duration ends (a flood), then hanging up whatever they still wait for; a refused
  request (429/503) waits 0.5 s before the next.

Every request asks for ``max_tokens`` tokens (``ignore_eos``; or a length drawn per request
from ``max_tokens_range``, the same sequence in every run), streamed unless the group says
``"stream": false``; a rate group may start after a ``delay``. A closed-loop group with
``"drain": true`` stops sending at the deadline but lets every request it has out finish
(so no work is thrown away at the end and engine tokens can be compared with received ones).
Per request the result has its start (seconds from the scenario's start), time to the first
content chunk (non-streaming: to the whole reply), latency, tokens received (the usage the
reply reports: ``stream_options.include_usage`` on streams; without usage, content chunks,
one token each from the simulator), HTTP status and the class the gateway put it in
(``x-tollgate-priority``). Per group it also has the content chunks received in each whole
second, for token shares over a window.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time

import aiohttp
import orjson

CONTENT = re.compile(rb'"content":\s*"[^"]')
USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
PROMPT = "Answer the user's question in a few sentences."


class Group:
    def __init__(self, spec: dict, t0: float) -> None:
        self.spec, self.t0 = spec, t0
        self.requests: list[list] = []  # [start, ttft, latency, tokens, status, class]
        self.per_second: dict[int, int] = {}
        self.first_error = ""
        low, high = spec.get("max_tokens_range", (spec.get("max_tokens"), spec.get("max_tokens")))
        self.stream = spec.get("stream", True)
        extra = {"stream_options": {"include_usage": True}} if self.stream else {}
        self.bodies = [
            orjson.dumps(
                {
                    "model": spec["model"],
                    "max_tokens": n,
                    "ignore_eos": True,
                    "stream": self.stream,
                    "messages": [{"role": "user", "content": PROMPT}],
                    **extra,
                }
            )
            for n in range(low, high + 1)
        ]
        self.random = random.Random(spec["key"])  # the same lengths in every run
        self.headers = {
            "content-type": "application/json",
            "authorization": f"Bearer {spec['key']}",
        }


async def one(session: aiohttp.ClientSession, url: str, g: Group) -> int:
    start = time.perf_counter()
    first, tokens, usage, status, klass = None, 0, None, 0, ""
    try:
        body = g.random.choice(g.bodies)
        async with session.post(url, data=body, headers=g.headers) as r:
            status, klass = r.status, r.headers.get("x-tollgate-priority", "")
            if r.status != 200:
                raw = await r.read()
                if not g.first_error:
                    g.first_error = f"HTTP {r.status}: {raw[:200]!r}"
            elif not g.stream:
                raw = await r.read()
                first = time.perf_counter()
                usage = orjson.loads(raw)["usage"]["completion_tokens"]
            else:
                buffer = b""
                async for chunk in r.content.iter_any():
                    buffer += chunk
                    *frames, buffer = buffer.split(b"\n\n")
                    for frame in frames:
                        if CONTENT.search(frame):
                            now = time.perf_counter()
                            if first is None:
                                first = now
                            tokens += 1
                            sec = int(now - g.t0)
                            g.per_second[sec] = g.per_second.get(sec, 0) + 1
                        elif b'"usage"' in frame and (found := USAGE.search(frame)):
                            usage = int(found.group(1))
    except Exception as exc:  # noqa: BLE001 - count it and go on
        status = status or -1
        if not g.first_error:
            g.first_error = f"{exc.__class__.__name__}: {exc}"[:300]
    end = time.perf_counter()
    g.requests.append(
        [
            round(start - g.t0, 4),
            round(first - start, 5) if first else None,
            round(end - start, 4),
            tokens if usage is None else usage,
            status,
            klass,
        ]
    )
    return status


async def run_group(session: aiohttp.ClientSession, url: str, g: Group, deadline: float) -> None:
    spec = g.spec
    if "rate" in spec:
        interval, tasks = 1.0 / spec["rate"], []
        for i in range(spec["count"]):
            at = g.t0 + spec.get("delay", 0.0) + i * interval
            if at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, g)))
        await asyncio.gather(*tasks)
        return

    async def client() -> None:
        while time.perf_counter() < deadline:
            if await one(session, url, g) != 200:
                await asyncio.sleep(0.5)

    clients = [asyncio.create_task(client()) for _ in range(spec["concurrency"])]
    if spec.get("drain"):  # every request sent before the deadline finishes
        await asyncio.gather(*clients)
        return
    # At the end the flood's clients hang up, queued or streaming, as impatient clients do:
    # nothing of theirs outlives the scenario.
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)


async def scenario(session: aiohttp.ClientSession, spec: dict) -> dict:
    url = spec["url"].rstrip("/") + "/v1/chat/completions"
    t0 = time.perf_counter()
    groups = {name: Group(g, t0) for name, g in spec["groups"].items()}
    deadline = t0 + spec["duration"]
    await asyncio.gather(*(run_group(session, url, g, deadline) for g in groups.values()))
    return {
        "seconds": time.perf_counter() - t0,
        "groups": {
            name: {"requests": g.requests, "per_second": g.per_second, "first_error": g.first_error}
            for name, g in groups.items()
        },
    }


async def main() -> None:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=900, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        print(orjson.dumps({"ready": True}).decode(), flush=True)
        while line := await reader.readline():
            result = await scenario(session, orjson.loads(line))
            print(orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS).decode(), flush=True)


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
