"""Engine janitor: removes this stack's engine containers when the stack goes down.

Engines are created by the worker through the Docker API, outside Compose, so
`docker compose down` would leave them running (and the engine network in use). This
process idles until it is stopped; Compose stops it (SIGTERM) on `down` and `stop`,
before the Docker socket proxy, and it then stops and removes every container labelled
for this stack and node, in parallel, within the grace period. Restarting `web` or
`worker` leaves engines alone.
"""

import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()

from django.conf import settings  # noqa: E402

from deployments import runtime  # noqa: E402


def remove_engines() -> int:
    """Stop and remove the stack's containers on this node; the number removed."""
    dc = runtime.client(settings.TOLLGATE_DOCKER_URL)
    stack, node = settings.TOLLGATE_STACK_ID, settings.TOLLGATE_LOCAL_NODE_NAME
    containers = runtime.list_managed(dc, stack, node)
    grace = int(os.environ.get("TOLLGATE_JANITOR_GRACE_SECONDS", "20"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda c: runtime.stop_and_remove(c, grace), containers))
    return len(containers)


def main() -> None:
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    if sys.argv[1:] == ["--now"]:
        stopping.set()
    else:
        print("janitor: idle; removes this stack's engines when stopped", flush=True)
    stopping.wait()
    removed = remove_engines()
    print(f"janitor: removed {removed} engine container(s)", flush=True)


if __name__ == "__main__":
    main()
