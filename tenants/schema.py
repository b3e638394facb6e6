"""OpenAPI description of admin API token authentication."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class AdminTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.auth.AdminTokenAuthentication"
    name = "adminToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "tga-<prefix>-<secret>",
            "description": "An admin API token created under /api/v1/tokens/.",
        }
