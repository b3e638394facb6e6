from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Models, nodes and deployments"

    def ready(self) -> None:
        from deployments import access as catalogue
        from deployments import schema  # noqa: F401 - registers the join-token auth scheme
        from tenants.access import provide_catalogue

        # The tenants app, a layer below, narrows keys to the models their tenant may call.
        provide_catalogue(catalogue)
