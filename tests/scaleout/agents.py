"""A node's agent as a thread of the test process, logged in as the node's own Redis ACL
user (made here as a join would make it), relaying to the Docker API at ``docker_url``."""

import hashlib
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from core.redis import get_redis
from deployments import credentials, relay
from nodeagent.agent import Agent, Config


@contextmanager
def agent_thread(name: str, docker_url: str, threads: int = 2) -> Iterator[Agent]:
    """The agent of node ``name`` runs while in the block; its Redis user is deleted after."""
    password = secrets.token_hex(16)
    redis_client = get_redis()
    rules = credentials.acl_rules(name, hashlib.sha256(password.encode()).hexdigest())
    redis_client.execute_command("ACL", "SETUSER", credentials.acl_user(name), *rules)
    kwargs = redis_client.connection_pool.connection_kwargs
    config = Config.from_env(
        {
            "TOLLGATE_NODE_NAME": name,
            "TOLLGATE_CONTROL_PLANE_REDIS": f"redis://{kwargs['host']}:{kwargs['port']}/0",
            "TOLLGATE_DOCKER_URL": docker_url,
            "TOLLGATE_AGENT_THREADS": str(threads),
            "TOLLGATE_AGENT_FACTS_SECONDS": "0.2",
        }
    )
    credential = {
        "redis_user": credentials.acl_user(name),
        "redis_password": password,
        "key_base": relay.key_base(name),
    }
    running = Agent(config, credential)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    try:
        yield running
    finally:
        running.stop()
        thread.join(timeout=10)
        redis_client.execute_command("ACL", "DELUSER", credentials.acl_user(name))
