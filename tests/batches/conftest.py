"""The real gateway subprocess and simulator engines of tests/gateway, plus batch helpers.

The gateway subprocess queues batch runs on a Celery broker; it gets its own Redis
database here, so test runs never leave work in a development worker's queue.
"""

import os

BROKER_URL = "redis://127.0.0.1:6379/13"
os.environ.setdefault("CELERY_BROKER_URL", BROKER_URL)  # read by the gateway subprocess

from tests.gateway.conftest import *  # noqa: E402,F403 - world, engines, gateway_url, redis_namespace
