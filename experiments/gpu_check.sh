#!/usr/bin/env bash
# The GPU check of the paged-attention kernels, run unchanged on a machine with a CUDA GPU
# and JAX's CUDA plugin installed (e.g. the lent H200 through the device tool):
#   bash experiments/gpu_check.sh [TAG]
# 1. the kernel test suites natively on the GPU (the same tests run in interpret mode on CPU),
# 2. the benchmark sweep: kernel vs jnp reference vs dense attention, with GB/s,
# printing a short table last. Results: experiments/results/bench_kernel_<TAG>.json, and a
# copy under $OUT when the device tool sets it.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG="${1:-gpu}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== native kernel tests =="
"$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention_kernel.py tests/kernels/test_ragged_paged_attention_kernel.py \
    tests/kernels/test_ragged_paged_attention_reference.py 2>&1 | tail -15
echo "== benchmark sweep =="
"$PY" -m experiments.bench_kernel --backend=gpu --tag="$TAG" --block_size=16,32 --num_seqs=8,32,64 \
    --context_len=512,2048 --num_heads=32 --num_kv_heads=8 --head_dim=128 --dtype=bfloat16,float32 --iters=20 \
    | tee /tmp/bench_kernel.txt | tail -2
if [ -n "${OUT:-}" ]; then cp experiments/results/bench_kernel_"$TAG".json "$OUT"/; fi
echo "== table (ms; ratio kernel/dense) =="
grep '^bs=' /tmp/bench_kernel.txt
