"""Pure rules: memory-fit arithmetic, container-state mapping, progress parsing,
engine environment and argument validation, backoff, metrics parsing."""

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError

from deployments import engine, lifecycle, planner, progress, runtime, services
from deployments.choices import ReplicaState
from deployments.engine_args import to_argv, validate_engine_args
from deployments.engine_env import validate_engine_env
from deployments.models import CatalogModel, Deployment, EngineProfile

# --- memory fit --------------------------------------------------------------------------------


def test_footprint_adds_weights_kv_cache_and_overhead() -> None:
    need = planner.footprint(8, "", 32768, 4, kv_bytes_per_token=131072)
    assert need.weights == 16_000_000_000
    assert need.kv_cache == planner.up(32768 * 4 * 131072) == 17_200_000_000
    assert need.overhead == 1_600_000_000
    assert need.per_replica == need.weights + need.kv_cache + need.overhead
    assert "8 B params × 2 bytes (bf16) = 16.0 GB" in need.explanation
    assert "32768 tokens × 4 seqs × 128 KiB/token (from the model) = 17.2 GB" in need.explanation


def test_quantization_and_fp8_kv_cache_shrink_the_footprint() -> None:
    full = planner.footprint(70, "", 8192, 4, kv_bytes_per_token=327680)
    small = planner.footprint(70, "nvfp4", 8192, 4, kv_bytes_per_token=327680, kv_cache_dtype="fp8")
    assert small.weights == planner.up(70e9 * 0.5625) and small.kv_cache < full.kv_cache


def test_moe_kv_estimate_follows_active_parameters() -> None:
    dense = planner.footprint(120, "mxfp4", 32768, 4)
    moe = planner.footprint(120, "mxfp4", 32768, 4, active_params_billions=5.1)
    assert moe.kv_cache < dense.kv_cache / 4


def test_a_120b_mxfp4_model_fits_a_spark_and_two_do_not() -> None:
    spark = planner.capacity(128 * 2**30, 118 * 2**30, 0, unified=True)
    need = planner.footprint(
        117,
        "mxfp4",
        32768,
        4,
        active_params_billions=5.1,
        gpu_memory_utilization=0.6,
        pool_bytes=128 * 2**30,
    )
    assert planner.check_fit(need, 1, 0, "spark", spark).fits
    verdict = planner.check_fit(need, 2, 0, "spark", spark)
    assert not verdict.fits
    assert "per replica × 2" in verdict.message and "> 126.7 GB" in verdict.message


def test_unified_capacity_counts_back_what_running_engines_hold() -> None:
    cap = planner.capacity(128 * GiB, 40 * GiB, 0, unified=True, held_by_running_engines=70 * GiB)
    assert cap.usable == planner.down(40 * GiB) + planner.down(70 * GiB)
    assert "available host memory 42.9 GB + 75.1 GB held" in cap.explanation
    assert planner.capacity(128 * GiB, 0, 80 * GiB, unified=False).usable == 85_800_000_000


def test_utilisation_too_small_for_the_model_is_refused() -> None:
    need = planner.footprint(70, "", 32768, 4, gpu_memory_utilization=0.5, pool_bytes=128 * GiB)
    verdict = planner.check_fit(need, 1, 0, "spark", planner.capacity(128 * GiB, 0, 0, True))
    assert not verdict.fits and "gives it only 68.8 GB" in verdict.message


GiB = 2**30


def test_the_printed_memory_arithmetic_adds_up() -> None:
    """Each sum on the page equals its printed parts, digit for digit (issue: 22.7 + 4.6 …)."""
    import re

    need = planner.footprint(
        11.7, "fp8", 40960, 3, gpu_memory_utilization=0.4, pool_bytes=128 * GiB
    )
    cap = planner.capacity(128 * GiB, 61 * GiB + 123_456_789, 0, True, 7 * GiB + 987_654_321)
    verdict = planner.check_fit(need, 2, 3 * 10**9 + 1, "spark", cap)
    number = r"([\d.]+) GB"
    w, k, o, total = re.search(
        rf"= {number} \+ KV cache .* = {number} \+ runtime overhead {number} = {number}",
        verdict.message,
    ).groups()
    assert round(float(w) + float(k) + float(o), 1) == float(total)
    per, n, product, others, grand = re.search(
        rf"{number} per replica × (\d+) = {number}, \+ {number} other engines on spark hold "
        rf"= {number}",
        verdict.message,
    ).groups()
    assert round(float(per) * int(n), 1) == float(product)
    assert round(float(product) + float(others), 1) == float(grand)
    avail, held, usable = re.search(
        rf"available host memory {number} \+ {number} held by Tollgate's running engines "
        rf"= {number}",
        verdict.message,
    ).groups()
    assert round(float(avail) + float(held), 1) == float(usable)


@pytest.mark.django_db
def test_service_refuses_a_deployment_that_does_not_fit(local_node: object) -> None:
    big = CatalogModel.objects.create(
        served_name="big", source="org/big", params_billions=Decimal("70"), context_length=131072
    )
    with pytest.raises(ValidationError) as refused:
        services.create_deployment(
            None,
            name="big",
            model=big,
            node=local_node,
            image="vllm/vllm-openai:v0.33.0",
            engine_args={"max-model-len": "128k", "max-num-seqs": 16},
        )
    message = refused.value.message_dict["memory"][0]
    assert "70 B params × 2 bytes (bf16) = 140.0 GB" in message and "137.4 GB" in message
    assert not Deployment.objects.exists()


@pytest.mark.django_db
def test_the_fit_preview_checks_flags_as_a_deployment_would_and_saves_nothing(
    local_node: object, public_model: CatalogModel
) -> None:
    with pytest.raises(ValidationError, match="--port cannot be set"):
        services.preview_fit(public_model, local_node, None, 1, {"port": 9999})
    small = services.preview_fit(
        public_model, local_node, None, 1, {"max-num-seqs": 4, "max-model-len": "8k"}
    )
    assert small.fits
    big = services.preview_fit(
        public_model, local_node, None, 16, {"max-num-seqs": 256, "max-model-len": "32k"}
    )
    assert not big.fits and "× 16" in big.message
    assert services.preview_fit(public_model, None, None, 1, {}) is None  # placed by Tollgate
    assert not Deployment.objects.exists()


# --- container state ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "headroom", "cores", "limit"),
    [
        (None, None, 8, None),  # no figure, no headroom: the engine may use every core
        (None, "0.5", 2, 1.5),  # the cpu profile on a two-core box
        (None, "0.5", 20, 19.5),
        (None, "1.5", 2, None),  # less than one core left: a throttled engine barely decodes
        (None, "0.5", 0, None),  # the node's cores are unknown
        ("1.5", None, 8, 1.5),  # the deployment's own figure wins
        ("1.5", "0.5", 8, 1.5),
        ("4", "0.5", 2, 2.0),  # at most the node's cores: Docker refuses more
        ("1.5", None, 0, 1.5),
    ],
)
def test_cpu_limit_is_the_deployment_s_or_the_node_s_cores_minus_the_profile_s_headroom(
    cpus: str | None, headroom: str | None, cores: int, limit: float | None
) -> None:
    profile = EngineProfile(pk=1, name="p", cpu_headroom=Decimal(headroom) if headroom else None)
    deployment = Deployment(profile=profile, cpus=Decimal(cpus) if cpus else None)
    assert deployment.cpu_limit(cores) == limit


@pytest.mark.parametrize(
    ("status", "health", "expected"),
    [
        (None, None, runtime.MISSING),
        ("created", None, ReplicaState.STARTING),
        ("running", None, ReplicaState.LOADING),
        ("running", 200, ReplicaState.READY),
        ("running", 503, ReplicaState.CRASHED),
        ("exited", None, ReplicaState.CRASHED),  # exit code 0 too: vLLM sometimes exits 0 on death
        ("dead", None, ReplicaState.CRASHED),
        ("restarting", None, ReplicaState.CRASHED),
        ("removing", None, ReplicaState.STOPPED),
    ],
)
def test_container_state_maps_to_replica_state(
    status: str | None, health: int | None, expected: str
) -> None:
    assert runtime.replica_state_for(status, health) == expected


def test_backoff_doubles_from_ten_seconds_to_five_minutes() -> None:
    assert [lifecycle.backoff_seconds(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]


# --- progress ----------------------------------------------------------------------------------


def test_shard_progress_reads_the_last_vllm_line() -> None:
    log = (
        "INFO starting\nLoading safetensors checkpoint shards:  10% Completed | 4/39 "
        "[00:03<00:30,  1.2it/s]\rLoading safetensors checkpoint shards:  46% Completed | "
        "18/39 [00:12<00:14,  1.50it/s]\n"
    )
    assert progress.shard_progress(log) == (18, 39)
    assert progress.shard_progress("INFO nothing yet") is None


def test_download_progress_reads_the_hf_cli_bar() -> None:
    log = "Fetching 39 files:  46%|████▌     | 18/39 [01:02<01:10,  3.4s/it]\r"
    assert progress.download_progress(log) == pytest.approx(100 * 18 / 39)
    assert progress.download_progress("Downloading config.json") is None


def test_pull_progress_sums_layers() -> None:
    layers: dict[str, tuple[int, int]] = {}
    progress.record_pull_event(
        layers,
        {"id": "a", "status": "Downloading", "progressDetail": {"current": 50, "total": 100}},
    )
    progress.record_pull_event(
        layers, {"id": "b", "status": "Downloading", "progressDetail": {"current": 0, "total": 300}}
    )
    assert progress.pull_progress(layers) == 12.5
    progress.record_pull_event(layers, {"id": "b", "status": "Pull complete"})
    assert progress.pull_progress(layers) == 87.5


# --- engine arguments and environment ----------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        {"host": "0.0.0.0"},
        {"port": 9000},
        {"api-key": "x"},
        {"trust-remote-code": True},
        {"tool-call-parser": "x; rm -rf /"},
        {"download-dir": "/etc"},
        {"chat-template": "/etc/passwd"},
        {"quantization": "$(id)"},
    ],
)
def test_dangerous_engine_flags_are_refused(args: dict) -> None:
    with pytest.raises(ValidationError):
        validate_engine_args(args)


def test_trust_remote_code_only_for_trusted_models() -> None:
    assert validate_engine_args({"trust-remote-code": True}, trust_remote_code_allowed=True)


@pytest.mark.parametrize(
    "name",
    [
        "LD_PRELOAD",
        "PYTHONPATH",
        "PATH",
        "HF_TOKEN",
        "VLLM_API_KEY",
        "VLLM_PLUGINS",
        "HTTPS_PROXY",
        "BASH_ENV",
        "lower",
    ],
)
def test_engine_env_refuses_dangerous_or_unlisted_names(name: str) -> None:
    with pytest.raises(ValidationError):
        validate_engine_env({name: "x"})


def test_engine_env_allows_engine_tuning() -> None:
    env = {
        "NCCL_SOCKET_IFNAME": "enp1s0f0np0",
        "VLLM_HOST_IP": "10.0.0.2",
        "RAY_memory_usage_threshold": "1.0",
        "SIM_LOAD_SECONDS": 2,
    }
    with pytest.raises(ValidationError):  # lower-case letters are not a valid name
        validate_engine_env(env)
    env.pop("RAY_memory_usage_threshold")
    assert validate_engine_env(env)["SIM_LOAD_SECONDS"] == "2"


def test_engine_command_is_vllm_serve_argv() -> None:
    model = CatalogModel(
        served_name="qwen3-8b",
        source="Qwen/Qwen3-8B",
        revision="abc123",
        params_billions=8,
        context_length=32768,
    )
    deployment = Deployment(
        model=model,
        engine_args={"max-num-seqs": 4, "enforce-eager": True, "enable-prefix-caching": False},
    )
    argv = engine.engine_command(deployment)
    assert argv[:7] == [
        "Qwen/Qwen3-8B",
        "--served-model-name",
        "qwen3-8b",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    assert argv[7:] == ["--revision", "abc123", *to_argv(deployment.engine_args)]
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv


@pytest.mark.parametrize(
    ("task", "args", "runner"),
    [
        ("generate", {}, None),
        ("embed", {}, "pooling"),
        ("score", {}, "pooling"),  # cross-encoders run on vLLM's pooling runner
        ("score", {"runner": "auto"}, "auto"),  # an explicit choice is kept
    ],
)
def test_pooling_tasks_get_the_pooling_runner(task: str, args: dict, runner: str | None) -> None:
    model = CatalogModel(
        served_name="m", source="org/m", task=task, params_billions=1, context_length=4096
    )
    argv = engine.engine_command(Deployment(model=model, engine_args=args))
    given = argv[argv.index("--runner") + 1] if "--runner" in argv else None
    assert given == runner and argv.count("--runner") <= 1


def test_metrics_parse_ignores_the_families_it_does_not_read() -> None:
    """Buckets, other counters whose names start like a read one, help and type lines: the
    figures are those of the read samples alone."""
    read = (
        "# HELP vllm:prompt_tokens_total Prefill tokens.\n# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{model_name="m"} 100\n'
        'vllm:prompt_tokens_cached_total{model_name="m"} 30\n'
        'vllm:num_requests_running{model_name="m"} 2\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 4\n'
    )
    noise = (
        "# TYPE vllm:prompt_tokens_by_source counter\n"
        'vllm:prompt_tokens_by_source_total{model_name="m",source="local_compute"} 70\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        + "".join(
            f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} 4\n'
            for le in ("0.01", "0.1", "1.0", "+Inf")
        )
        + 'vllm:num_requests_running_max{model_name="m"} 9\n'
        + "process_cpu_seconds_total 12.5\n"
    )
    expected = {
        "prompt_tokens_total": 100,
        "prompt_tokens_cached_total": 30,  # read: the bill's check compares cached tokens
        "running": 2,
        "ttft_seconds_sum": 0.5,
        "ttft_count": 4,
    }
    assert engine.parse_metrics(read) == expected
    assert engine.parse_metrics(noise + read + noise) == expected


def test_metrics_parse_reads_old_and_new_names() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 1\n'
        '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{model_name="m"} 42\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 3\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0\n'
    )
    figures = engine.parse_metrics(text)
    assert figures == {
        "running": 3,
        "waiting": 1,
        "kv_cache_usage": 0.5,
        "generation_tokens_total": 42,
        "ttft_seconds_sum": 1.5,
        "ttft_count": 3,
        "kv_capacity_tokens": 32768,  # the KV cache: 2,048 blocks of 16 tokens
    }
