"""``python -m dockerpolicy``: the docker-proxy service (see dockerpolicy/__init__.py)."""

import argparse
import asyncio
import logging
import os
import signal
import sys

from dockerpolicy.server import serve
from dockerpolicy.settings import Settings, SettingsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dockerpolicy", description=__doc__)
    parser.add_argument(
        "--listen",
        default=os.environ.get("TOLLGATE_DOCKER_POLICY_LISTEN", "0.0.0.0:2375"),
        help="host:port to serve the Docker API on (default 0.0.0.0:2375)",
    )
    parser.add_argument(
        "--docker-socket",
        default="/var/run/docker.sock",
        help="the Docker Engine's socket (default /var/run/docker.sock)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        logging.getLogger("dockerpolicy").error("%s", exc)
        return 2
    host, _, port = args.listen.rpartition(":")
    asyncio.run(run(settings, host or "0.0.0.0", int(port), args.docker_socket))
    return 0


async def run(settings: Settings, host: str, port: int, socket_path: str) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await serve(settings, host, port, socket_path, stop)


if __name__ == "__main__":
    sys.exit(main())
