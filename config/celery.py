"""The Celery application shared by the worker, beat and the web process (to queue tasks)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("tollgate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
