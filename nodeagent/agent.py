"""The node agent's work: join once, then relay Docker calls and report the box's facts."""

import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from nodeagent import protocol
from nodeagent.facts import box_facts

log = logging.getLogger("nodeagent")

EXIT_REVOKED = 0  # compose restarts the agent on failure only: a revoked node stays down
EXIT_JOIN_REFUSED = 2
ALIVE_FILE = Path(tempfile.gettempdir()) / "tollgate-agent-alive"


class BodyAborted(Exception):
    """A streamed request body stopped before its end (the sender failed or went silent)."""


@dataclass(frozen=True)
class Config:
    """The agent's environment: no secret of the control plane's, only this node's own."""

    name: str
    control_plane_url: str
    redis_url: str
    docker_url: str
    credential_file: Path
    join_token: str
    engine_host: str
    high_speed_interface: str
    high_speed_address: str
    unified_memory: bool
    threads: int
    facts_seconds: float
    # Refused this long without a break: revoked. Shorter refusals happen when the
    # control plane's Redis restarted and its next pass has not restored the user yet.
    revoked_after_seconds: float

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Config":
        env = dict(os.environ if env is None else env)
        url = env.get("TOLLGATE_CONTROL_PLANE_URL", "").rstrip("/")
        host = urlsplit(url).hostname or "localhost"
        return cls(
            name=env.get("TOLLGATE_NODE_NAME", ""),
            control_plane_url=url,
            redis_url=env.get("TOLLGATE_CONTROL_PLANE_REDIS") or f"redis://{host}:6379/0",
            docker_url=env.get("TOLLGATE_DOCKER_URL", "tcp://docker-proxy:2375"),
            credential_file=Path(
                env.get("TOLLGATE_NODE_CREDENTIAL_FILE", "/var/lib/tollgate/node-credential.json")
            ),
            join_token=_secret(env, "TOLLGATE_JOIN_TOKEN"),
            engine_host=env.get("TOLLGATE_NODE_ENGINE_HOST", ""),
            high_speed_interface=env.get("TOLLGATE_NODE_HIGH_SPEED_INTERFACE", ""),
            high_speed_address=env.get("TOLLGATE_NODE_HIGH_SPEED_ADDRESS", ""),
            unified_memory=env.get("TOLLGATE_NODE_UNIFIED_MEMORY", "").lower() in {"1", "true"},
            threads=int(env.get("TOLLGATE_AGENT_THREADS", "8")),
            facts_seconds=float(env.get("TOLLGATE_AGENT_FACTS_SECONDS", "5")),
            revoked_after_seconds=float(env.get("TOLLGATE_AGENT_REVOKED_AFTER_SECONDS", "30")),
        )


def _secret(env: dict[str, str], name: str) -> str:
    path = env.get(f"{name}_FILE")
    return Path(path).read_text().strip() if path else env.get(name, "").strip()


# --- Joining ----------------------------------------------------------------------------


def join(config: Config) -> dict[str, str]:
    """Exchange the one-time join token for this node's credential (kept in a 0600 file)."""
    if config.credential_file.exists():
        return json.loads(config.credential_file.read_text())
    if not (config.join_token and config.name and config.control_plane_url):
        raise SystemExit(
            "Set TOLLGATE_JOIN_TOKEN, TOLLGATE_NODE_NAME and TOLLGATE_CONTROL_PLANE_URL."
        )
    reply = httpx.post(
        f"{config.control_plane_url}/api/v1/nodes/join/",
        headers={"Authorization": f"Bearer {config.join_token}"},
        json={
            "name": config.name,
            "engine_host": config.engine_host,
            "high_speed_interface": config.high_speed_interface,
            "high_speed_address": config.high_speed_address or None,
            "unified_memory": config.unified_memory,
        },
        timeout=30,
    )
    if reply.status_code != 201:
        log.error("the control plane refused the join (%s): %s", reply.status_code, reply.text)
        raise SystemExit(EXIT_JOIN_REFUSED)
    credential = {k: reply.json()[k] for k in ("name", "redis_user", "redis_password", "key_base")}
    _write_private(config.credential_file, json.dumps(credential))
    log.info("joined as %s", credential["name"])
    return credential


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    tmp.replace(path)


# --- Relaying ---------------------------------------------------------------------------


def docker_http(docker_url: str) -> tuple[httpx.Client, str]:
    """An HTTP client for the box's Docker API policy and the base URL to put paths on."""
    parts = urlsplit(docker_url)
    if parts.scheme in {"unix", "http+unix"}:
        transport = httpx.HTTPTransport(uds=parts.path)
        return httpx.Client(transport=transport, timeout=_timeout()), "http://docker"
    return httpx.Client(timeout=_timeout()), f"http://{parts.netloc}"


def _timeout() -> httpx.Timeout:
    # A pull or a container wait may take as long as it takes; the caller's deadline rules.
    return httpx.Timeout(connect=10.0, read=None, write=60.0, pool=10.0)


class Agent:
    """Relay threads and a facts thread on one Redis connection pool as the node's user."""

    def __init__(self, config: Config, credential: dict[str, str]) -> None:
        self.config = config
        self.base = credential["key_base"]
        self.redis = redis.Redis.from_url(
            config.redis_url,
            username=credential["redis_user"],
            password=credential["redis_password"],
            socket_keepalive=True,
            health_check_interval=15,
        )
        self.stopping = threading.Event()
        self.revoked = threading.Event()
        self.refused_since: float | None = None
        self.lock = threading.Lock()

    def run(self) -> int:
        threads = [threading.Thread(target=self._guard(self._facts_loop), daemon=True)]
        threads += [
            threading.Thread(target=self._guard(self._relay_loop), daemon=True)
            for _ in range(self.config.threads)
        ]
        for thread in threads:
            thread.start()
        while not self.stopping.wait(0.5):
            pass
        if self.revoked.is_set():
            log.error("%s: the control plane revoked this node's credential", self.config.name)
            return EXIT_REVOKED
        return 0

    def stop(self, *_: object) -> None:
        self.stopping.set()

    def _guard(self, loop: Any) -> Any:
        def run() -> None:
            backoff = 0.5
            while not self.stopping.is_set():
                try:
                    loop()
                    backoff = 0.5
                except (AuthenticationError, NoPermissionError) as exc:
                    self._refused(exc)
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                except redis.ConnectionError as exc:
                    log.warning("control plane's Redis: %s (retrying)", exc)
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, 10.0)

        return run

    def _refused(self, exc: Exception) -> None:
        with self.lock:
            now = time.monotonic()
            self.refused_since = self.refused_since or now
            if now - self.refused_since >= self.config.revoked_after_seconds:
                self.revoked.set()
                self.stopping.set()
        log.warning("the control plane refuses this node's credential: %s", exc)

    def _facts_loop(self) -> None:
        while not self.stopping.is_set():
            self._report_facts()
            with self.lock:
                self.refused_since = None
            self.stopping.wait(self.config.facts_seconds)

    def _report_facts(self) -> None:
        facts = {**box_facts(), "at": time.time()}
        ttl = max(int(self.config.facts_seconds * 3), 10)
        self.redis.set(protocol.facts_key(self.base), json.dumps(facts), ex=ttl)
        ALIVE_FILE.touch()  # the container's health check reads its age

    def _relay_loop(self) -> None:
        client, root = docker_http(self.config.docker_url)
        with client:
            while not self.stopping.is_set():
                item = self.redis.brpop([protocol.rpc_key(self.base)], timeout=2)
                if item is not None:
                    self._answer(client, root, json.loads(item[1]))

    def _answer(self, client: httpx.Client, root: str, request: dict[str, Any]) -> None:
        if request.get("deadline", 0) < time.time():
            log.info("dropped a stale request: %s %s", request["method"], request["path"])
            return
        key = protocol.reply_key(self.base, request["id"])
        headers = protocol.end_to_end(request.get("headers") or {})
        if any(k.lower() == "upgrade" for k in request.get("headers") or {}):
            self._push(key, {"status": 501, "headers": {}}, {"end": True})
            return  # attach/exec hijack a socket: nothing Tollgate's engines need
        if request.get("length") is not None:
            headers["Content-Length"] = str(request["length"])  # httpx then sends it unchunked
        body = self._body(request)
        try:
            with client.stream(
                request["method"], root + request["path"], headers=headers, content=body
            ) as reply:
                self._push(key, {"status": reply.status_code, "headers": dict(reply.headers)})
                for chunk in reply.iter_raw():
                    self._push(key, {"data": protocol.b64(chunk)})
            self._push(key, {"end": True})
        except httpx.HTTPError as exc:
            self._push(key, {"error": f"the node's Docker API does not answer: {exc}"})
        except BodyAborted as exc:
            # httpx closed Docker's connection mid-body: Docker drops the call, waits for nothing.
            self._push(key, {"error": f"the request body did not arrive: {exc}"})

    def _body(self, request: dict[str, Any]) -> bytes | Iterator[bytes] | None:
        if request.get("body_key"):
            return self._streamed_body(request["body_key"])
        return protocol.unb64(request["body"]) if request.get("body") else None

    def _streamed_body(self, key: str) -> Iterator[bytes]:
        """The chunks of a streamed body as they arrive; raises BodyAborted when they stop."""
        while True:
            item = self.redis.brpop([key], timeout=protocol.BODY_CHUNK_WAIT_SECONDS)
            if item is None:
                wait = protocol.BODY_CHUNK_WAIT_SECONDS
                raise BodyAborted(f"the control plane sent nothing for {wait:g} s")
            message = json.loads(item[1])
            if message.get("end"):
                return
            if "error" in message:
                raise BodyAborted(message["error"])
            yield protocol.unb64(message["data"])

    def _push(self, key: str, *messages: dict[str, Any]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, *(json.dumps(m) for m in messages))
        pipe.expire(key, protocol.REPLY_TTL_SECONDS)
        pipe.execute()


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("TOLLGATE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per relayed call
    config = Config.from_env()
    agent = Agent(config, join(config))
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    return agent.run()
