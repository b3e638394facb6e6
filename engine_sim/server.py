"""Process life cycle: the vLLM-like start-up (logs, shard progress, not listening until
loaded), serving, fault injection (crash, hang) and shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

from engine_sim import VLLM_VERSION
from engine_sim.api import App
from engine_sim.cli import Config, parse
from engine_sim.engine import Engine
from engine_sim.errors import ApiError
from engine_sim.http import Server

PID = os.getpid()


def log(source: str, msg: str, level: str = "INFO", where: str = "api_server.py:1") -> None:
    """A log line in vLLM's format, e.g. `(APIServer pid=7) INFO 11-26 01:12:00 [x.py:1] msg`."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({source} pid={PID}) {level} {stamp} [{where}] {msg}", flush=True)


def uvicorn(msg: str) -> None:
    print(f"(APIServer pid={PID}) INFO:     {msg}", flush=True)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60:02d}:{s % 60:02d}"


def shard_line(done: int, total: int, elapsed: float, per_shard: float) -> str:
    """tqdm's line with vLLM's bar_format, e.g.
    `Loading safetensors checkpoint shards:  45% Completed | 18/39 [00:12<00:14,  1.50it/s]`."""
    pct = 100 * done / total
    remaining = per_shard * (total - done)
    if done == 0 or per_shard <= 0:
        rate = "?it/s"
    elif per_shard < 1:
        rate = f"{1 / per_shard:5.2f}it/s"
    else:
        rate = f"{per_shard:5.2f}s/it"
    return (
        f"Loading safetensors checkpoint shards: {pct:3.0f}% Completed | {done}/{total} "
        f"[{_clock(elapsed)}<{_clock(remaining)}, {rate}]"
    )


def bind(cfg: Config) -> socket.socket:
    """Bind the port now but listen only once loaded, like vLLM: clients get refused meanwhile."""
    host = None if cfg.host in ("", "0.0.0.0") else cfg.host
    family = (
        socket.AF_INET
        if host is None
        else socket.getaddrinfo(host, cfg.port, type=socket.SOCK_STREAM)[0][0]
    )
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "0.0.0.0", cfg.port))
    except OSError as exc:
        log("APIServer", f"OSError: {exc}", "ERROR")
        sys.exit(1)
    sock.setblocking(False)
    return sock


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, or less if `stop` is set meanwhile; whether it was."""
    try:
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
    except TimeoutError:
        return False
    return True


async def load(cfg: Config, engine: Engine, stop: asyncio.Event) -> bool:
    """Pretend to load weights, printing vLLM's progress lines; maybe die like an OOM.
    False if SIGTERM (`stop`) came first: the process then exits 0 without serving."""
    s = cfg.sim
    log(
        "EngineCore_DP0",
        f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: "
        f"model='{cfg.model}', served_model_name={cfg.served_names[0]}, "
        f"max_seq_len={cfg.max_model_len}",
        where="core.py:93",
    )
    shards = max(1, s.sim_shards)
    per = max(0.0, s.sim_load_seconds) / shards
    start = time.monotonic()
    for done in range(shards + 1):
        if done and await _stopped_within(stop, per):
            return False
        if done == shards and engine.load_held:
            log("EngineCore_DP0", "loading held before the last shard until SIGUSR1")
            while engine.load_held:
                if await _stopped_within(stop, 0.05):
                    return False
        if s.sim_load_fail_exit_code is not None and done == shards // 2 + 1:
            log(
                "EngineCore_DP0",
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                "2.00 GiB. GPU 0 has a total capacity of 119.70 GiB",
                "ERROR",
                "core.py:708",
            )
            log(
                "APIServer",
                "RuntimeError: Engine core initialization failed. See root cause above.",
                "ERROR",
                "api_server.py:1",
            )
            sys.exit(s.sim_load_fail_exit_code)
        line = shard_line(done, shards, time.monotonic() - start, per)
        print(f"(EngineCore_DP0 pid={PID}) {line}", file=sys.stderr, flush=True)
    took = time.monotonic() - start
    log("EngineCore_DP0", f"Loading weights took {took:.2f} seconds", where="default_loader.py:268")
    log(
        "EngineCore_DP0",
        f"Model loading took 1.23 GiB and {took:.6f} seconds",
        where="gpu_model_runner.py:2020",
    )
    if s.sim_slow_start_seconds > 0:
        if await _stopped_within(stop, s.sim_slow_start_seconds):
            return False
        log(
            "EngineCore_DP0",
            f"torch.compile takes {s.sim_slow_start_seconds:.2f} s in total",
            where="monitor.py:34",
        )
    kv = s.sim_kv_cache_tokens or cfg.max_num_seqs * cfg.max_model_len
    log("EngineCore_DP0", f"GPU KV cache size: {kv:,} tokens", where="kv_cache_utils.py:1087")
    return True


class Process:
    """Holds the running server and decides when and how the process ends."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.engine.on_fatal = self.crash
        self.app = App(cfg, self.engine)
        self.server = Server(self.app, finish_abandoned=bool(cfg.sim.sim_finish_abandoned))
        self.exit: asyncio.Future[int] | None = None
        self.stop: asyncio.Event | None = None

    def crash(self) -> None:
        """Engine death: /health 503 and in-flight requests fail, then the process exits."""
        if self.engine.dead:
            return
        log("EngineCore_DP0", "EngineCore encountered a fatal error.", "ERROR", "core.py:710")
        log(
            "APIServer",
            "AsyncLLM output_handler failed. EngineDeadError: EngineCore encountered an "
            "issue. See stack trace (above) for the root cause.",
            "ERROR",
            "async_llm.py:480",
        )
        self.engine.kill()
        grace = max(0.0, self.cfg.sim.sim_crash_grace_seconds)
        asyncio.get_running_loop().call_later(grace, self._finish, self.cfg.sim.sim_crash_exit_code)

    def hang(self) -> None:
        self.engine.hung = True  # silent, like a wedged GPU

    def _finish(self, code: int) -> None:
        if self.exit is not None and not self.exit.done():
            self.exit.set_result(code)

    def _on_request_done(self, n: int) -> None:
        s = self.cfg.sim
        if s.sim_crash_after_requests and n >= s.sim_crash_after_requests:
            self.crash()
        if s.sim_hang_after_requests and n >= s.sim_hang_after_requests:
            self.hang()

    async def _drain(self) -> None:
        """SIGTERM: stop accepting; with --shutdown-timeout, let in-flight requests finish.
        While loading, loading stops and the process exits 0."""
        self.stop.set()
        log("APIServer", "Shutting down FastAPI HTTP server.")
        self.server.stop_listening()
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        while self.app.server_load and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._finish(0)

    def _arm_faults(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.cfg.sim
        self.app.on_request_done = self._on_request_done
        if s.sim_crash_after_seconds > 0:
            loop.call_later(s.sim_crash_after_seconds, self.crash)
        if s.sim_hang_after_seconds > 0:
            loop.call_later(s.sim_hang_after_seconds, self.hang)

    def _arm_signals(self) -> None:
        """From the start, loading included: SIGTERM/SIGINT end the process with 0, SIGUSR1
        releases --sim-hold/--sim-hold-load, SIGUSR2 kills the engine."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: loop.create_task(self._drain()))
        loop.add_signal_handler(signal.SIGUSR1, self.engine.release_hold)
        loop.add_signal_handler(signal.SIGUSR2, self.crash)  # die now, mid-request

    async def run(self) -> int:
        cfg = self.cfg
        log("APIServer", f"vLLM API server version {VLLM_VERSION}", where="api_server.py:1896")
        log(
            "APIServer",
            f"args: model={cfg.model!r} served_model_name={cfg.served_names} "
            f"max_model_len={cfg.max_model_len} max_num_seqs={cfg.max_num_seqs}",
            where="utils.py:326",
        )
        sock = bind(cfg)
        self.exit = asyncio.get_running_loop().create_future()
        self.stop = asyncio.Event()
        self._arm_signals()
        if not await load(cfg, self.engine, self.stop) or self.exit.done():
            code = await self.exit
            log("APIServer", f"Engine process exiting (code {code}).")
            return code
        log(
            "APIServer",
            f"Starting vLLM API server 0 on http://{cfg.host}:{cfg.port}",
            where="launcher.py:37",
        )
        uvicorn(f"Started server process [{PID}]")
        uvicorn("Waiting for application startup.")
        uvicorn("Application startup complete.")
        await self.server.serve(sock)
        uvicorn(f"Uvicorn running on http://{cfg.host}:{cfg.port} (Press CTRL+C to quit)")
        self._arm_faults()
        code = await self.exit
        self.server.stop_listening()
        self.server.close_all()
        log("APIServer", f"Engine process exiting (code {code}).")
        return code


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    try:
        process = Process(cfg)
    except ApiError as err:
        # vLLM stops at start-up on an adapter named by --lora-modules it cannot load.
        sys.exit(f"ValueError: {err.message}")
    try:
        code = asyncio.run(process.run())
    except KeyboardInterrupt:
        code = 0
    sys.stdout.flush()
    sys.exit(code)
