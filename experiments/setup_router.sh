#!/usr/bin/env bash
# vllm-router (vLLM's Rust request router, PyPI) in a venv of its own, for experiments/serve_fleet.py.
#
#     bash experiments/setup_router.sh                     # skips what is there
#     ROUTER_VENV=/tmp/router-venv bash experiments/setup_router.sh
#
# Why vllm-router (measured against sglang-router 0.3.2, README "Fleets"): it passes every vLLM
# request extension paged_jax serves (cache_salt, priority, kv_transfer_params, structured outputs,
# token-id prompts) through unchanged, its cache-aware policy matches token prefixes through the
# replicas' /tokenize, and its prefill / decode mode is the kv_transfer_params handshake paged_jax's
# server speaks. Why a venv of its own: it is a separate program with its own dependencies; ~130 MB.
#
# Environment (optional): ROUTER_VENV (default $HOME/.cache/paged_jax/router-venv), PYTHON (python3.11).
set -euo pipefail
ROUTER_VENV="${ROUTER_VENV:-$HOME/.cache/paged_jax/router-venv}"
PYTHON="${PYTHON:-python3.11}"
ROUTER_SPEC="vllm-router==0.1.17"
if [ -x "$ROUTER_VENV/bin/vllm-router" ] && "$ROUTER_VENV/bin/vllm-router" --help > /dev/null 2>&1; then
  echo "vllm-router is installed: $ROUTER_VENV/bin/vllm-router"
  exit 0
fi
"$PYTHON" -m venv "$ROUTER_VENV"
"$ROUTER_VENV/bin/pip" install --quiet "$ROUTER_SPEC"
"$ROUTER_VENV/bin/vllm-router" --help > /dev/null
echo "vllm-router installed: $ROUTER_VENV/bin/vllm-router"
