"""System checks for engine settings (ids tollgate.E010–E019)."""

from typing import Any

from django.conf import settings
from django.core.checks import Error, register


@register()
def check_engine_images(app_configs: Any, **kwargs: Any) -> list[Error]:
    if not settings.TOLLGATE_ENGINE_IMAGES:
        return [
            Error(
                "TOLLGATE_ENGINE_IMAGES is empty: no deployment could ever start.",
                hint="List allowed engine images, e.g. vllm/vllm-openai:*",
                id="tollgate.E010",
            )
        ]
    return []
