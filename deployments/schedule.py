"""Celery beat entries of the deployments app (merged into CELERY_BEAT_SCHEDULE)."""

from deployments.conf import DEFAULTS

BEAT_SCHEDULE: dict[str, dict] = {
    # Fans out to every node's queue: reconcile + heartbeat; external engines' health.
    "deployments-reconcile": {
        "task": "deployments.reconcile_all",
        "schedule": DEFAULTS["TOLLGATE_RECONCILE_SECONDS"],
        "options": {"expires": DEFAULTS["TOLLGATE_RECONCILE_SECONDS"] * 2},
    },
    # Engine /metrics into Redis for admission decisions and the console.
    "deployments-telemetry": {
        "task": "deployments.scrape_engines",
        "schedule": 5.0,
        "options": {"expires": 10.0},
    },
}
