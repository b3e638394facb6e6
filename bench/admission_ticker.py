"""What Celery beat would run during an admission benchmark, in one small process.

Every ``--every`` seconds (beat's 5 s): scrape the engines' /metrics into Redis
(``deployments.fleet.scrape_all``, what ``deployments.scrape_engines`` runs) when
``--scrape``, then run the adaptive-ceiling controller (``gateway.tuning.tune_all``, what
``gateway.tune_admission`` runs) when ``--tune``. Prints one JSON line per tick with the
controller's decision and ceiling, so the bench can show the ceiling over time; says it is
ready once its first tick is done. Stops on SIGTERM or when stdin closes.

    DATABASE_URL=… TOLLGATE_REDIS_PREFIX=… \
        .venv/bin/python bench/admission_ticker.py --scrape --tune
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrape", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--every", type=float, default=5.0)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from admission_setup import tick as as_tick

    from deployments.fleet import scrape_all
    from gateway.models import AdmissionSample
    from gateway.tuning import tune_all

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    t0 = time.monotonic()
    first = True
    while not stop.is_set():
        tick = time.monotonic()
        if a.scrape:
            scrape_all()
        if a.tune:
            last = AdmissionSample.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
            tune_all()
            for s in AdmissionSample.objects.filter(pk__gt=last).order_by("pk"):
                print(json.dumps({"t": round(tick - t0, 2), **as_tick(s)}), flush=True)
        if first:
            # Ready once the first tick is done: the controller has seen the engine idle
            # once (and asked it whether it drops abandoned requests, gateway/tuning.py), as
            # beat has long before any flood on a running appliance.
            print(json.dumps({"ready": True}), flush=True)
            first = False
        stop.wait(max(0.0, a.every - (time.monotonic() - tick)))


if __name__ == "__main__":
    main()
