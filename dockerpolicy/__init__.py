"""Tollgate's Docker API policy: the ``docker-proxy`` service.

The only process that holds ``/var/run/docker.sock``. It listens on TCP (2375 on the
internal ``docker-api`` network), decides every call on its method, its normalised path,
its query and its body decoded the way Docker's Go decoder reads it, and forwards to Docker
only a canonical re-serialisation of exactly what it checked (never the client's bytes), so
no difference between two JSON parsers can carry anything past it. Everything the engine
lifecycle does not need is refused with 403 and one log line saying why.

A leaf package: it imports nothing of Tollgate's Django apps and reads its configuration
from the environment (``dockerpolicy.settings``). Run it with ``python -m dockerpolicy``.
"""
