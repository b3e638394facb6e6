"""Fills the vllm stage's compile cache volume before its tests run.

vLLM compiles the test model's kernels on an engine's first start on a machine (about 35 s
on two cores), once for engines without adapters and once for engines with them enabled;
every later start loads them from the volume (``$VLLM_TEST_COMPILE``). ``scripts/test``
runs this as part of the stage's preparation, in the background beside the faults stage, so
the stage's own engines (the same ``start_shared_engine`` and ``start_lora_engine`` as its
fixtures) start warm even on a fresh machine:

    python -m tests.vllm.warm_compile

Starting an engine whose kernels are cached already costs a start and nothing more, so this
is safe to run again.
"""

import os
import time


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from tests.vllm.conftest import start_lora_engine, start_shared_engine

    for kind, start in (
        ("without adapters", start_shared_engine),
        ("with adapters", start_lora_engine),
    ):
        began = time.monotonic()
        start().stop()
        print(f"[warm-compile] engine {kind}: healthy in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
