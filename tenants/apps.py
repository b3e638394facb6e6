from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants and API keys"

    def ready(self) -> None:
        from tenants import schema  # noqa: F401 - registers the auth scheme
