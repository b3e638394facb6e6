"""Celery beat entries of the deployments app (merged into CELERY_BEAT_SCHEDULE)."""


def beat_schedule(reconcile_seconds: float) -> dict[str, dict]:
    """The entries, for the reconcile interval settings.py read (TOLLGATE_RECONCILE_SECONDS)."""
    return {
        # Fans out to every node's queue: reconcile + heartbeat; external engines' health.
        "deployments-reconcile": {
            "task": "deployments.reconcile_all",
            "schedule": reconcile_seconds,
            "options": {"expires": reconcile_seconds * 2},
        },
        # On-demand deployments unused for their idle timeout are stopped.
        "deployments-sleep-idle": {
            "task": "deployments.sleep_idle",
            "schedule": 10.0,
            "options": {"expires": 20.0},
        },
        # Engine /metrics into Redis for admission decisions and the console.
        "deployments-telemetry": {
            "task": "deployments.scrape_engines",
            "schedule": 5.0,
            "options": {"expires": 10.0},
        },
    }
