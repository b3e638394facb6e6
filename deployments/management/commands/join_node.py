"""Join this box to a Tollgate control plane as a node (run by the node agent on start)."""

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from config.env import env_bool, env_secret, env_str
from deployments import fleet, joining


class Command(BaseCommand):
    help = (
        "Claim this node's row with a join token (TOLLGATE_JOIN_TOKEN) and send a first "
        "heartbeat. Safe to run on every start: a used token stays valid for its node."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default=env_str("TOLLGATE_NODE_NAME", ""))
        parser.add_argument(
            "--docker-url", default=env_str("TOLLGATE_DOCKER_URL", "tcp://docker-proxy:2375")
        )
        parser.add_argument(
            "--engine-host",
            default=env_str("TOLLGATE_NODE_ENGINE_HOST", ""),
            help="address the gateway reaches this node's engines at",
        )
        parser.add_argument(
            "--high-speed-interface", default=env_str("TOLLGATE_NODE_HIGH_SPEED_INTERFACE", "")
        )
        parser.add_argument(
            "--high-speed-address", default=env_str("TOLLGATE_NODE_HIGH_SPEED_ADDRESS", "")
        )

    def handle(self, *args: Any, **options: Any) -> None:
        token = env_secret("TOLLGATE_JOIN_TOKEN")
        if not token or not options["name"]:
            raise CommandError("Set TOLLGATE_JOIN_TOKEN and TOLLGATE_NODE_NAME (from the console).")
        if not options["engine_host"]:
            raise CommandError(
                "Set TOLLGATE_NODE_ENGINE_HOST: the address of this box the "
                "control plane's gateway reaches engines at."
            )
        try:
            node = joining.claim_node(
                token,
                options["name"],
                docker_url=options["docker_url"],
                engine_host=options["engine_host"],
                high_speed_interface=options["high_speed_interface"],
                high_speed_address=options["high_speed_address"] or None,
                unified_memory=env_bool("TOLLGATE_NODE_UNIFIED_MEMORY", False) or None,
            )
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        node = fleet.heartbeat(node)
        self.stdout.write(
            f"join_node: {node.name} joined (queue {node.queue}, {node.arch}, "
            f"{node.total_memory_bytes / 1e9:.1f} GB, GPUs: {node.gpu_description or 'none'}, "
            f"Docker {node.docker_version or 'unreachable'})"
        )
