"""OpenAPI description of the node agents' join-token authentication."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class JoinTokenScheme(OpenApiAuthenticationExtension):
    target_class = "deployments.api.JoinTokenAuthentication"
    name = "joinToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "tgj-<prefix>-<secret>",
            "description": "A node's one-time join token from POST /api/v1/nodes/join-token/.",
        }
