from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Models, nodes and deployments"

    def ready(self) -> None:
        from deployments import schema  # noqa: F401 - registers the join-token auth scheme
