#!/usr/bin/env bash
# A request router (PyPI, Rust) in a venv of its own, for experiments/serve_fleet.py.
#
#     bash experiments/setup_router.sh                     # vllm-router (the default router); skips what is there
#     bash experiments/setup_router.sh sglang              # sglang-router (serve_fleet --router=sglang)
#     ROUTER_VENV=/tmp/router-venv bash experiments/setup_router.sh
#
# Why vllm-router by default (measured against sglang-router 0.3.2, docs/fleets.md): it passes every
# vLLM request extension paged_jax serves (cache_salt, priority, kv_transfer_params, structured
# outputs, token-id prompts) through unchanged, its cache-aware policy matches token prefixes through
# the replicas' /tokenize, and its prefill / decode mode is the kv_transfer_params handshake paged_jax's
# server speaks. Why sglang-router as well: its cache-aware policy sends a prompt that matches no
# replica to the replica with the smallest prompt tree, which keeps a fleet balanced where
# vllm-router's (fewest in flight, first on a tie) does not. Why a venv of its own: each router is a
# separate program with its own dependencies; ~130 MB (vllm-router), ~90 MB (sglang-router).
#
# Environment (optional): ROUTER_VENV (default $HOME/.cache/paged_jax/router-venv), SGLANG_ROUTER_VENV
# (default $HOME/.cache/paged_jax/sglang-router-venv), PYTHON (python3.11).
set -euo pipefail
ROUTER="${1:-vllm}"
PYTHON="${PYTHON:-python3.11}"
case "$ROUTER" in
  vllm)
    VENV="${ROUTER_VENV:-$HOME/.cache/paged_jax/router-venv}"; SPEC="vllm-router==0.1.17"; BIN="vllm-router"; CHECK=(--help) ;;
  sglang)
    # 0.2.3: the last release whose cache_aware sends an unmatched prompt to the smallest tree (0.2.4
    # and later send it to the least-loaded replica, as vllm-router does); it has no console script
    VENV="${SGLANG_ROUTER_VENV:-$HOME/.cache/paged_jax/sglang-router-venv}"; SPEC="sglang-router==0.2.3"
    BIN="python"; CHECK=(-m sglang_router.launch_router --help) ;;
  *)
    echo "usage: bash experiments/setup_router.sh [vllm|sglang]" >&2; exit 2 ;;
esac
if [ -x "$VENV/bin/$BIN" ] && "$VENV/bin/$BIN" "${CHECK[@]}" > /dev/null 2>&1; then
  echo "$SPEC is installed: $VENV/bin/$BIN"
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$SPEC"
"$VENV/bin/$BIN" "${CHECK[@]}" > /dev/null
echo "$SPEC installed: $VENV/bin/$BIN"
