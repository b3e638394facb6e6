"""gunicorn settings for the web role.

    gunicorn -c python:config.gunicorn config.asgi:application

Uvicorn workers (the ASGI app: console, admin API and the /v1 gateway). Each worker keeps
its own Prometheus metrics; so that ``/metrics`` shows the sum over all workers (not
whichever worker happens to answer), they write them to ``PROMETHEUS_MULTIPROC_DIR``,
made fresh here before the workers start, and a worker that exits is marked dead.

New connections are spread evenly over the workers (``TOLLGATE_WEB_BALANCE``, on by
default): each worker accepts one at a time and steps back while it holds more than
another (config/web.py), using per-worker connection counts in memory this master shares
with the workers it forks. ``bench/worker_spread_bench.py`` measures the splits.
"""

import os
import shutil
import tempfile

from config.web import BOARD

BALANCE = os.environ.get("TOLLGATE_WEB_BALANCE", "true").lower() not in ("0", "false", "no")
worker_class = "config.web.BalancedUvicornWorker" if BALANCE else "uvicorn_worker.UvicornWorker"
# gunicorn's runtime control socket (``gunicornc``) would live in $HOME/.gunicorn, which is
# the read-only image in the container; nothing in Tollgate uses it.
control_socket_disable = True

_made_here = not os.environ.get("PROMETHEUS_MULTIPROC_DIR")
if _made_here:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="tollgate-metrics-")
else:
    # Files of an earlier run would be added to this run's counters.
    _dir = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    shutil.rmtree(_dir, ignore_errors=True)
    os.makedirs(_dir, exist_ok=True)


def child_exit(server: object, worker: object) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
    if getattr(worker, "tollgate_slot", None) is not None:
        BOARD.free(worker.tollgate_slot)


def on_exit(server: object) -> None:
    if _made_here:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


def pre_fork(server: object, worker: object) -> None:
    worker.tollgate_slot = BOARD.claim() if BALANCE else None


def post_fork(server: object, worker: object) -> None:
    if worker.tollgate_slot is not None:
        BOARD.start(worker.tollgate_slot, os.getpid())
