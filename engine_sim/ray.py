"""A stand-in for the Ray runtime, so the simulator image can be started the way a
two-box vLLM deployment is (``ray start --head`` … ``vllm serve`` on the head node,
``ray start --address=<head>:<port> --block`` on the worker node).

It is not Ray. It only reproduces what Tollgate orchestrates and must observe:

- ``start --head --port P --num-workers N --timeout T -- <vllm serve args>``: listens on
  port P, waits until N workers joined (exit 3 with a clear message after T seconds),
  then runs the simulator engine with the remaining arguments in this process; the
  listener keeps running, so workers notice when the head goes away.
- ``start --address HOST:P --block --timeout T``: joins the head (retrying for T seconds,
  exit 2 when it cannot reach it: the misconfigured-interconnect case), then blocks
  until the head closes the connection (exit 1, as a Ray worker dies with its head).

Both print the interconnect environment (VLLM_HOST_IP, NCCL_SOCKET_IFNAME, ...) the way
Ray and NCCL would log it. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

ENV_SHOWN = (
    "VLLM_HOST_IP",
    "NCCL_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "GLOO_SOCKET_IFNAME",
    "RAY_memory_usage_threshold",
)


def say(text: str) -> None:
    print(f"[ray-standin] {text}", file=sys.stderr, flush=True)


def show_env() -> None:
    say(" ".join(f"{name}={os.environ.get(name, '')}" for name in ENV_SHOWN))


class Head:
    """Accepts worker registrations and keeps their connections open."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        self.workers: list[tuple[str, socket.socket]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            conn, peer = self.sock.accept()
            try:
                conn.settimeout(5)
                hello = conn.recv(256).decode(errors="replace").strip()
                conn.settimeout(None)
            except OSError:
                conn.close()
                continue
            if not hello.startswith("JOIN "):
                conn.close()
                continue
            conn.sendall(b"OK\n")
            with self.lock:
                self.workers.append((hello[5:], conn))
            say(f"worker node joined from {peer[0]} (VLLM_HOST_IP {hello[5:]})")

    def wait(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.workers) >= count:
                    return True
            time.sleep(0.1)
        return False


def run_head(port: int, workers: int, timeout: float, engine_args: list[str]) -> None:
    show_env()
    head = Head(port)
    say(f"Ray runtime started (head) on port {port}; waiting for {workers} worker node(s)")
    if not head.wait(workers, timeout):
        say(
            f"timed out after {timeout:g} s waiting for {workers} Ray worker node(s) to join "
            f"the head at {os.environ.get('VLLM_HOST_IP', '?')}:{port}"
        )
        sys.exit(3)
    say(f"{workers + 1} Ray nodes alive; starting vllm serve")
    from engine_sim.server import main

    main(engine_args)


def run_worker(address: str, timeout: float) -> None:
    show_env()
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((host, int(port)), timeout=2)
            conn.sendall(f"JOIN {os.environ.get('VLLM_HOST_IP', '')}\n".encode())
            if conn.recv(16).startswith(b"OK"):
                break
            conn.close()
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    else:
        say(
            f"could not reach the Ray head at {address} within {timeout:g} s ({last}); "
            "check the nodes' high-speed interface, addresses and firewall"
        )
        sys.exit(2)
    conn.settimeout(None)
    say(f"joined the Ray head at {address}; blocking")
    while conn.recv(1024):
        pass
    say("the Ray head went away; exiting")
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="ray", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start"])
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--address", default="")
    parser.add_argument("--port", type=int, default=6379)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--block", action="store_true")
    args = parser.parse_args(argv)
    if args.head:
        run_head(args.port, args.num_workers, args.timeout, engine_args)
    elif args.address:
        run_worker(args.address, args.timeout)
    else:
        parser.error("give --head or --address")


if __name__ == "__main__":
    main()
