from django.apps import AppConfig


class TollgateConfig(AppConfig):
    """The project-wide pieces under config/ that need the app registry: system checks."""

    name = "config"
    label = "tollgate"
    verbose_name = "Tollgate"

    def ready(self) -> None:
        from config import checks  # noqa: F401 - registers the system checks
