"""A recording relay between the Docker API policy and the Docker Engine's socket.

The hostile-request suite (test_hostile.py) must show that a refused request changed
nothing on the engine. Comparing the whole engine before and after cannot tell that on a
machine where other processes create and remove containers, volumes and networks
meanwhile; what passed from the policy to the engine can. The policy is pointed at this
relay's Unix socket instead of the engine's; the relay pipes every connection through to
the engine unchanged and records the request line of every HTTP request it carried.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from pathlib import Path

REQUEST_LINE = re.compile(rb"(?:^|\r\n)([A-Z]+) (\S+) HTTP/1\.[01]\r\n")
READ_ONLY = frozenset(("GET", "HEAD"))


class RecordingRelay:
    """Listens on ``path``; every connection is relayed to the engine's socket ``target``."""

    def __init__(self, path: Path, target: str) -> None:
        self.path, self.target = path, target
        self._lock = threading.Lock()
        self._sent: list[bytearray] = []  # per connection: what the policy sent the engine
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def requests(self) -> list[tuple[str, str]]:
        """(method, target) of every request relayed so far, connection by connection."""
        with self._lock:
            streams = [bytes(s) for s in self._sent]
        return [
            (m.group(1).decode(), m.group(2).decode(errors="replace"))
            for stream in streams
            for m in REQUEST_LINE.finditer(stream)
        ]

    def writes_since(self, count: int) -> list[tuple[str, str]]:
        """The relayed requests after the first ``count`` that could change the engine."""
        return [r for r in self.requests()[count:] if r[0] not in READ_ONLY]

    def close(self) -> None:
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                engine.connect(self.target)
            except OSError:
                client.close()
                continue
            sent = bytearray()
            with self._lock:
                self._sent.append(sent)
            threading.Thread(target=self._pipe, args=(client, engine, sent), daemon=True).start()
            threading.Thread(target=self._pipe, args=(engine, client, None), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if record is not None:
                    with self._lock:
                        record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
