"""The contract between Tollgate's planes: what the gateway, metering, the control plane and
the console share.

A leaf package: it imports Django's settings and database helpers and libraries (redis,
orjson), never a Tollgate app, so every app may import it and it never pulls one in.

- ``core.hot``: settings read on the gateway's hot path, cached.
- ``core.redis``: the process-wide Redis client.
- ``core.keyspace``: every Redis key and pub/sub channel the planes share.
- ``core.usage``: the usage record the gateway appends to the usage stream.
- ``core.changes``: the change channel that tells gateway processes to reload.
- ``core.pricing``: money in integer nano-units and the one cost formula.
- ``core.credentials``: which key a ``/v1`` request presents, and which keys are usable.
"""
