"""The web workers' accept loop: new connections spread evenly over the gunicorn workers.

All workers listen on the one socket gunicorn opens. Left to the event loop, the worker
that wakes first accepts a whole burst of new connections (splits of 15/1 and 16/0 were
measured), so one event loop carries them all while the other idles; with per-worker
``SO_REUSEPORT`` sockets the kernel hashes each connection to a worker, which is even only
on average (a binomial split: a burst of 16 over two workers lands 11/5 or worse about one
time in five). So each worker accepts one connection
at a time and, before it does, compares the connections it holds with the other workers'
(counts in memory the gunicorn master shares with its workers, see config/gunicorn.py): a
worker that holds more than the least-loaded one steps back for a millisecond, so that one
accepts; after ``MAX_DEFERS`` steps back it accepts anyway (the others may be busy), so
no connection waits more than a few milliseconds for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import socket
import struct
import sys

from gunicorn.arbiter import Arbiter
from uvicorn.server import STARTUP_FAILURE, Server
from uvicorn_worker import UvicornWorker

MAX_WORKERS = 64
DEFER_SECONDS = 0.001
MAX_DEFERS = 3
_SLOT = struct.Struct("qq")  # pid, connections held


class Board:
    """Per-worker connection counts in anonymous shared memory (made before the fork)."""

    def __init__(self) -> None:
        self.mem = mmap.mmap(-1, _SLOT.size * MAX_WORKERS)

    def claim(self) -> int | None:
        """A free slot for a worker about to be forked (in the master)."""
        for i in range(MAX_WORKERS):
            if _SLOT.unpack_from(self.mem, i * _SLOT.size)[0] == 0:
                _SLOT.pack_into(self.mem, i * _SLOT.size, -1, 0)  # taken, not started
                return i
        return None

    def start(self, slot: int, pid: int) -> None:
        _SLOT.pack_into(self.mem, slot * _SLOT.size, pid, 0)

    def free(self, slot: int) -> None:
        _SLOT.pack_into(self.mem, slot * _SLOT.size, 0, 0)

    def add(self, slot: int, delta: int) -> None:
        pid, held = _SLOT.unpack_from(self.mem, slot * _SLOT.size)
        _SLOT.pack_into(self.mem, slot * _SLOT.size, pid, max(held + delta, 0))

    def behind_others(self, slot: int) -> bool:
        """True when this worker holds more connections than the least-loaded other one."""
        mine, least = None, None
        for i in range(MAX_WORKERS):
            pid, held = _SLOT.unpack_from(self.mem, i * _SLOT.size)
            if pid <= 0:
                continue
            if i == slot:
                mine = held
            elif least is None or held < least:
                least = held
        return mine is not None and least is not None and mine > least


BOARD = Board()


class Acceptor:
    """Accepts a listening socket's connections one at a time, stepping back while other
    workers hold fewer; looks like the ``asyncio.Server`` uvicorn keeps."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, factory: object, sock: object, ssl: object, slot: int
    ) -> None:
        self.loop, self.factory, self.ssl, self.slot = loop, factory, ssl, slot
        self.sock = sock.sock if hasattr(sock, "sock") else sock  # gunicorn's wrapper
        self.fd = self.sock.fileno()
        self.defers = 0
        self.closed = asyncio.Event()
        self.pending: set[asyncio.Task] = set()
        loop.add_reader(self.fd, self._ready)

    def _ready(self) -> None:
        if self.defers < MAX_DEFERS and BOARD.behind_others(self.slot):
            self.defers += 1
            self.loop.remove_reader(self.fd)
            self.loop.call_later(DEFER_SECONDS, self._resume)
            return
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return  # another worker took it
        except OSError:
            return  # e.g. the peer reset it while it waited (ECONNABORTED), or EMFILE
        self.defers = 0
        BOARD.add(self.slot, 1)
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self.loop.create_task(self._connect(conn))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn, ssl=self.ssl)
        except Exception:  # noqa: BLE001 - e.g. a TLS handshake that failed
            BOARD.add(self.slot, -1)
            conn.close()

    def _resume(self) -> None:
        if not self.closed.is_set():
            self.loop.add_reader(self.fd, self._ready)

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.fd)

    async def wait_closed(self) -> None:
        await self.closed.wait()


class BalancedServer(Server):
    """uvicorn's server with the balanced accept loop on the sockets gunicorn passes."""

    slot: int = 0

    async def startup(self, sockets: list | None = None) -> None:
        if sockets is None or self.config.workers > 1 and sys.platform == "win32":
            return await super().startup(sockets)
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config, slot = self.config, self.slot
        protocol = config.http_protocol_class

        class Counted(protocol):  # the connection leaves this worker's count when it ends
            def connection_lost(self, exc: Exception | None) -> None:
                BOARD.add(slot, -1)
                super().connection_lost(exc)

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return Counted(
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=_loop,
            )

        loop = asyncio.get_running_loop()
        self.servers = [Acceptor(loop, create_protocol, s, config.ssl, slot) for s in sockets]
        self.started = True
        return None


class BalancedUvicornWorker(UvicornWorker):
    """A uvicorn worker whose connections are balanced with the other workers' (it needs
    the slot config/gunicorn.py's ``pre_fork`` gives it; without one it is uvicorn's)."""

    async def _serve(self) -> None:
        slot = getattr(self, "tollgate_slot", None)
        if slot is None:
            return await super()._serve()
        self.config.app = self.wsgi
        server = BalancedServer(config=self.config)
        server.slot = slot
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        return None
