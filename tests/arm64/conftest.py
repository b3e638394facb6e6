"""The arm64 stage (``./scripts/test arm64``) runs only when its marker is asked for.

Its test starts linux/arm64 containers under qemu emulation, which takes minutes and needs
the images from ``scripts/build-images --arch arm64``; the other stages select tests by
marker expressions that do not mention ``arm64``, so without this hook they would pick it
up. Deselected tests are reported as deselected, never as passed or skipped.
"""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "arm64" in (config.getoption("markexpr") or ""):
        return
    arm64 = [item for item in items if item.get_closest_marker("arm64")]
    if arm64:
        config.hook.pytest_deselected(items=arm64)
        items[:] = [item for item in items if not item.get_closest_marker("arm64")]
