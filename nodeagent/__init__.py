"""Tollgate's node agent: what runs on every box beyond the control plane's own.

It holds no control-plane secret — no database password, no Django secret key — and no
rule: it imports nothing of Tollgate's Django apps. On first start it exchanges its one-time
join token at the control plane (``POST /api/v1/nodes/join/``) for a per-node credential, a
Redis ACL user that may touch only ``<prefix>:node:<name>:*``. Over it the agent relays the
Docker API calls the control plane's worker makes for this node to the box's own Docker API
policy (which still refuses anything an engine does not need), and reports what the box is
(memory, GPUs). Revoking the node deletes that user: Redis drops the connection, the next
login is refused and the agent exits. Run it with ``python -m nodeagent``.
"""
