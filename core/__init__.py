"""What every app may import: the contract between Tollgate's planes and the building blocks
the apps share.

A leaf package: it imports Django, Django REST framework and libraries (redis, orjson,
celery, cryptography), never a Tollgate app and never ``config`` (the composition root,
which imports the apps), so every app may import it and it never pulls one in.

The planes' contract:

- ``core.hot``: settings read on the gateway's hot path, cached.
- ``core.redis``: the process-wide Redis client.
- ``core.keyspace``: every Redis key and pub/sub channel the planes share.
- ``core.usage``: the usage record the gateway appends to the usage stream.
- ``core.changes``: the change channel that tells gateway processes to reload.
- ``core.pricing``: money in integer nano-units and the one cost formula.
- ``core.credentials``: which key a ``/v1`` request presents, and which keys are usable.

Shared building blocks:

- ``core.errors``: the errors services raise that every caller understands.
- ``core.api``, ``core.parsers``, ``core.problems``: the admin API's conventions (strict
  serializers, viewset mixins, JSON-object bodies, problem-details errors).
- ``core.fields``: model fields that keep secrets encrypted at rest.
- ``core.tasks``: queuing a Celery task by name.
"""
