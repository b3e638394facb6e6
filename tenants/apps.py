from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants and API keys"

    def ready(self) -> None:
        from tenants import checks, schema  # noqa: F401 - registers checks and the auth scheme
