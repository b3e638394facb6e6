"""Engine arguments: only allow-listed vllm flags, typed, never file or network options."""

import pytest
from django.core.exceptions import ValidationError

from deployments.engine_args import to_argv, validate_engine_args


def errors_of(args: object, **kwargs: bool) -> list[str]:
    with pytest.raises(ValidationError) as error:
        validate_engine_args(args, **kwargs)
    return error.value.message_dict["engine_args"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"api-key": "x"}, "--api-key cannot be set"),
        ({"--port": 9000}, "--port cannot be set"),
        ({"chat-template": "/etc/passwd"}, "--chat-template cannot be set"),
        ({"served-model-name": "other"}, "--served-model-name cannot be set"),
        ({"privileged": True}, "--privileged is not an allowed engine flag"),
        ({"max-num-seqs": 0}, "--max-num-seqs expects a whole number from 1 to 4096"),
        ({"max-num-seqs": "4; rm -rf /"}, "--max-num-seqs expects a whole number"),
        (
            {"gpu-memory-utilization": 1.5},
            "--gpu-memory-utilization expects a number from 0.05 to 0.98",
        ),
        ({"kv-cache-dtype": "int2"}, "--kv-cache-dtype expects one of auto, fp8"),
        ({"scheduling-policy": "lifo"}, "--scheduling-policy expects one of fcfs, priority"),
        ({"reasoning-parser": "../../x"}, "--reasoning-parser expects a plain name"),
        ({"max-model-len": "lots"}, "--max-model-len expects a token count"),
        ({"enforce-eager": "yes"}, "--enforce-eager expects true or false"),
        ({"enable-auto-tool-choice": True}, "needs --tool-call-parser"),
        ({"trust-remote-code": True}, "Only for models an admin marked"),
        ({"lora-modules": "a=/etc"}, "--lora-modules cannot be set"),
        ({"max-loras": 2}, "--max-loras needs --enable-lora"),
        ({"enable-lora": True, "max-lora-rank": 12}, "--max-lora-rank expects one of 1, 8, 16"),
        (
            {"enable-lora": True, "max-loras": 4, "max-cpu-loras": 2},
            "--max-cpu-loras must be at least --max-loras",
        ),
    ],
)
def test_bad_engine_args_are_refused_with_the_flag_named(args: dict, message: str) -> None:
    assert any(message in error for error in errors_of(args))


def test_every_bad_flag_is_reported_at_once() -> None:
    assert len(errors_of({"api-key": "x", "host": "0.0.0.0", "max-num-seqs": -1})) == 3


def test_not_an_object_is_refused() -> None:
    assert "Give an object of flags" in errors_of(["--max-num-seqs", "4"])[0]


def test_good_args_are_normalised_and_rendered_as_argv() -> None:
    args = validate_engine_args(
        {
            "--max-model-len": "32k",
            "max-num-seqs": 4,
            "gpu-memory-utilization": "0.8",
            "enable-prefix-caching": False,
            "enforce-eager": True,
            "enable-auto-tool-choice": True,
            "tool-call-parser": "hermes",
            "trust-remote-code": True,
            "scheduling-policy": "priority",
        },
        trust_remote_code_allowed=True,
    )
    assert args["max-model-len"] == 32768 and args["gpu-memory-utilization"] == 0.8
    assert to_argv(args) == [
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "4",
        "--gpu-memory-utilization",
        "0.8",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--trust-remote-code",
        "--scheduling-policy",
        "priority",
    ]


@pytest.mark.parametrize("value", ["³", "٤", "4\n", "-4", 4.0, True])
def test_a_whole_number_is_ascii_digits(value: object) -> None:
    errors = errors_of({"max-num-seqs": value})
    assert any("--max-num-seqs expects a whole number" in error for error in errors)
