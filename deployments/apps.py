from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Models, nodes and deployments"

    def ready(self) -> None:
        from deployments import checks  # noqa: F401 - registers the system checks
