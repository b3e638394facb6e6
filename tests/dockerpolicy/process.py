"""The Docker API policy as a real process on a loopback port, in front of the real socket.

Deployment tests point their nodes at it (``tests/deployments/conftest.py``'s ``stack``), so
every call the worker makes goes through the policy, which logs each one it allowed and each
one it refused. The log is kept under ``.pytest-dockerpolicy/`` for reading afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG_DIR = ROOT / ".pytest-dockerpolicy"


def docker_socket() -> str:
    host = os.environ.get("DOCKER_HOST", "")
    return host[len("unix://") :] if host.startswith("unix://") else "/var/run/docker.sock"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PolicyProcess:
    """A running ``python -m dockerpolicy``; stopped by its PID."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def refusals(self) -> list[str]:
        return [line for line in self.lines() if " refused " in line]

    def allowed(self) -> list[str]:
        return [line for line in self.lines() if " allowed " in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def policy_env(stack: str, images: list[str], **more: str) -> dict[str, str]:
    """The environment the appliance would give the policy for this stack."""
    return {
        **os.environ,
        "TOLLGATE_STACK_ID": stack,
        "TOLLGATE_MODEL_CACHE_VOLUME": f"{stack}-models",
        "TOLLGATE_COMPILE_CACHE_VOLUME": f"{stack}-compile",
        "TOLLGATE_ENGINE_NETWORK": f"{stack}-net",
        "TOLLGATE_ENGINE_IMAGES": ",".join(images),
        "TOLLGATE_DOCKER_POLICY_LOG": "all",
        **more,
    }


def start_policy(env: dict[str, str], log_name: str, socket_path: str = "") -> PolicyProcess:
    """Start the policy and wait (up to 30 s) until it accepts connections."""
    LOG_DIR.mkdir(exist_ok=True)
    log_path = LOG_DIR / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', log_name)[:150]}.log"
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dockerpolicy",
            "--listen",
            f"127.0.0.1:{port}",
            "--docker-socket",
            socket_path or docker_socket(),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "w"),  # noqa: SIM115
    )
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the policy exited with {proc.returncode}: {log_path.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return PolicyProcess(proc, port, log_path)
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("the policy did not start listening within 30 s") from None
            time.sleep(0.05)
