"""The gateway's pipelined Redis connection against a real redis-server of the test's own
(started and stopped here by PID, so pausing or killing it disturbs nobody else)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.exceptions

from gateway import redispipe
from gateway.redispipe import RedisPipe, Script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, directory: Path, password: str | None = None) -> None:
        self.port, self.dir, self.password = free_port(), directory, password
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, password=self.password)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path).start()
    yield s
    s.stop()


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_concurrent_calls_each_get_their_own_reply(server: Server) -> None:
    async def scenario() -> list:
        pipe = RedisPipe(port=server.port)
        try:
            return await asyncio.gather(
                *(pipe.call("INCR", "n") for _ in range(2000)),
                *(pipe.call("SET", f"k{i}", i) for i in range(100)),
                pipe.call("GET", "k7"),
            )
        finally:
            await pipe.aclose()

    replies = run(scenario())
    assert sorted(replies[:2000]) == list(range(1, 2001))
    assert replies[2000:2100] == [b"OK"] * 100
    assert server.client().get("n") == b"2000"


def test_a_script_is_loaded_again_after_the_script_cache_is_flushed(server: Server) -> None:
    script = Script("return {tonumber(ARGV[1]) * 2, KEYS[1]}")

    async def scenario() -> tuple:
        pipe = RedisPipe(port=server.port)
        try:
            first = await pipe.evalsha(script, ["a"], [21])
            server.client().script_flush()  # what a Redis restart does to the script cache
            second = await pipe.evalsha(script, ["b"], [4])
            return first, second
        finally:
            await pipe.aclose()

    assert run(scenario()) == ([42, b"a"], [8, b"b"])


def test_keys_used_once_are_not_kept_among_the_encoded_keys(server: Server) -> None:
    script = Script("redis.call('SET', KEYS[1], ARGV[1]) return redis.call('GET', KEYS[1])")

    async def scenario() -> tuple:
        pipe = RedisPipe(port=server.port)
        try:
            kept = await pipe.evalsha(script, ["every-request"], [1])
            once = await pipe.evalsha(script, ["resp:one-record"], [2], keep_keys=False)
            return kept, once
        finally:
            await pipe.aclose()

    assert run(scenario()) == (b"1", b"2")
    assert "every-request" in redispipe._KEY_CACHE
    assert "resp:one-record" not in redispipe._KEY_CACHE
    assert server.client().get("resp:one-record") == b"2"


def test_an_error_reply_raises_and_the_connection_stays_in_step(server: Server) -> None:
    async def scenario() -> tuple:
        pipe = RedisPipe(port=server.port)
        try:
            await pipe.call("SET", "s", "text")
            outcomes = await asyncio.gather(
                pipe.call("INCR", "s"), pipe.call("GET", "s"), return_exceptions=True
            )
            return outcomes[0], outcomes[1], await pipe.call("EVAL", "return redis.call('nope')", 0)
        finally:
            await pipe.aclose()

    with pytest.raises(redis.exceptions.ResponseError, match="Unknown Redis command"):
        run(scenario())

    async def in_step() -> tuple:
        pipe = RedisPipe(port=server.port)
        try:
            return tuple(
                await asyncio.gather(
                    pipe.call("INCR", "s"), pipe.call("GET", "s"), return_exceptions=True
                )
            )
        finally:
            await pipe.aclose()

    error, value = run(in_step())
    assert isinstance(error, redis.exceptions.ResponseError) and "not an integer" in str(error)
    assert value == b"text"


def test_a_cancelled_caller_does_not_shift_the_next_callers_reply(server: Server) -> None:
    async def scenario() -> bytes:
        pipe = RedisPipe(port=server.port)
        try:
            await pipe.call("SET", "x", "mine")
            slow = asyncio.create_task(pipe.call("BLPOP", "nothing", "0.3"))
            await asyncio.sleep(0.05)
            slow.cancel()
            return await pipe.call("GET", "x")
        finally:
            await pipe.aclose()

    assert run(scenario()) == b"mine"


def test_a_hung_redis_fails_calls_within_the_timeout_then_recovers(server: Server) -> None:
    async def scenario() -> tuple[float, object, bytes]:
        pipe = RedisPipe(port=server.port, timeout=0.3)
        try:
            await pipe.call("SET", "y", "1")
            server.client().execute_command(
                "CLIENT", "PAUSE", "1500", "ALL"
            )  # Redis stops answering
            t0 = time.monotonic()
            outcome = await asyncio.gather(
                pipe.call("GET", "y"), pipe.call("GET", "y"), return_exceptions=True
            )
            elapsed = time.monotonic() - t0
            await asyncio.sleep(1.5)  # the pause ends
            return elapsed, outcome, await pipe.call("GET", "y")
        finally:
            await pipe.aclose()

    elapsed, outcome, after = run(scenario())
    assert all(isinstance(o, TimeoutError) for o in outcome), outcome
    assert 0.25 <= elapsed < 1.0
    assert after == b"1"


def test_a_dead_redis_fails_calls_with_a_connection_error_then_recovers(server: Server) -> None:
    async def scenario() -> tuple[list, bytes]:
        pipe = RedisPipe(port=server.port)
        try:
            await pipe.call("SET", "z", "1")
            server.stop()
            down = await asyncio.gather(
                pipe.call("GET", "z"), pipe.call("GET", "z"), return_exceptions=True
            )
            server.start()
            return down, await pipe.call("SET", "z", "2")
        finally:
            await pipe.aclose()

    down, after = run(scenario())
    assert all(isinstance(o, OSError) for o in down), down  # ConnectionError / refused
    assert after == b"OK"


def test_password_and_database_from_the_url(tmp_path: Path) -> None:
    server = Server(tmp_path, password="s3cret-pw").start()
    try:

        async def scenario(url: str) -> bytes:
            pipe = RedisPipe.from_url(url)
            try:
                return await pipe.call("SET", "in-db-3", "yes")
            finally:
                await pipe.aclose()

        assert run(scenario(f"redis://:s3cret-pw@127.0.0.1:{server.port}/3")) == b"OK"
        assert server.client(db=3).get("in-db-3") == b"yes"
        assert server.client(db=0).get("in-db-3") is None
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGPASS|invalid password"):
            run(scenario(f"redis://:wrong@127.0.0.1:{server.port}/3"))
    finally:
        server.stop()


def test_like_a_redis_py_client_reaches_the_same_server_and_database(server: Server) -> None:
    async def scenario() -> bytes:
        pipe = RedisPipe.like(redis.asyncio.Redis(port=server.port, db=5))
        try:
            return await pipe.call("SET", "via-like", "1")
        finally:
            await pipe.aclose()

    assert run(scenario()) == b"OK"
    assert server.client(db=5).get("via-like") == b"1"


def test_send_now_has_written_the_command_before_it_returns(server: Server) -> None:
    """What the gateway sends its client next leaves after the command: Redis receives the
    command even while this event loop never runs again (a blocking client looks)."""
    sync = server.client()

    async def scenario() -> tuple[bytes | None, bytes]:
        pipe = RedisPipe(port=server.port)
        try:
            await pipe.call("PING")  # connected
            reply = await pipe.send_now(redispipe.encode(("SET", "early", "yes")))
            deadline = time.monotonic() + 10
            seen = sync.get("early")  # blocking: this loop does not run meanwhile
            while seen is None and time.monotonic() < deadline:
                seen = sync.get("early")
            return seen, await reply
        finally:
            await pipe.aclose()

    assert run(scenario()) == (b"yes", b"OK")
