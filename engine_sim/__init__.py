"""A stand-in for `vllm serve`: vLLM's HTTP API, timing and failure modes, no GPU."""

VLLM_VERSION = "0.33.0"
