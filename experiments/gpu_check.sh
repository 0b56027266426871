#!/usr/bin/env bash
# The GPU check of the paged-attention kernels and the engine, run unchanged on a machine with
# a CUDA GPU and JAX's CUDA plugin installed (e.g. the lent H200 through the device tool):
#   bash experiments/gpu_check.sh [TAG]
# Stages, each bounded in time so that one failing stage leaves the others' results:
# 1. the kernel test suites natively on the GPU (`-m gpu`: the same tests run in interpret mode
#    on CPU), including TritonTunings of every kind the sweep below varies, and the engine's
#    GPU attention (decode steps to the decode kernel, the rest to the ragged one);
# 2. the kernel benchmarks (experiments/bench_kernel.py): the device's memory bandwidth and
#    bf16 matmul rate, then decode kernels vs the jnp reference, dense attention and JAX's own
#    Pallas GPU kernel on a grid of batches (record bench_kernel_<TAG>), and a sweep of
#    TritonTunings on decode batches of 16 and 64 sequences and on prefill chunks
#    (bench_kernel_<TAG>_tunings), with GB/s and fractions of the ceilings;
# 3. the engine end to end (experiments/attention_backends.py): SmolLM2-135M's shapes with random
#    weights (the real ones are too large to carry), 64 ShareGPT-like requests, the jnp
#    reference vs the Pallas kernels (and the XLA decode loop) in bfloat16: output tok/s and
#    greedy agreement; then float32 with full-f32 matmuls (GPUs default to TF32), where the
#    outputs must be equal up to near ties.
# Results: experiments/results/{bench_kernel_<TAG>,bench_kernel_<TAG>_tunings,attention_backends_<TAG>,
# attention_backends_<TAG>_f32}.json,
# logs, and copies under $OUT when the device tool sets it. The stage limits and sizes are
# environment variables (TEST_S, BENCH_S, SWEEP_S, ENGINE_S, TEST_WORKERS; TEST_ARGS, BENCH_ARGS,
# SWEEP_ARGS, ENGINE_ARGS are appended to the commands), so a CPU dry run can shrink them.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG="${1:-gpu}"
PY="${PYTHON:-python3}"
LOGS="${OUT:-/tmp/gpu_check_$TAG}"
mkdir -p "$LOGS"
# on demand, not 75% up front: the test stage runs several JAX processes on the one GPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
TEST_S="${TEST_S:-130}" BENCH_S="${BENCH_S:-90}" SWEEP_S="${SWEEP_S:-150}" ENGINE_S="${ENGINE_S:-170}"
TEST_WORKERS="${TEST_WORKERS:-6}"  # pytest-xdist processes: the tests' time is compiling, on the CPUs
# The kernels' launch choices the sweep compares (pallas_kernels/triton_tuning.py labels)
TUNINGS="${TUNINGS:-c64-w4,c256-w4,c128-w8-s3,c128-k1,c128-k2,c128-k4,c128-r64,c64-r128,c32-r64}"

echo "== device =="
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tail -2
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tail -1

echo "== 1. native kernel tests (${TEST_S}s max) =="
timeout "$TEST_S" "$PY" -m pytest -v -p no:cacheprovider -m gpu -o addopts="" -n "$TEST_WORKERS" tests/kernels \
    ${TEST_ARGS:-} > "$LOGS/tests.log" 2>&1
echo "exit $? (124: timed out); PASSED $(grep -c ' PASSED' "$LOGS/tests.log") FAILED $(grep -c ' FAILED' "$LOGS/tests.log")"
grep -E "passed|failed" "$LOGS/tests.log" | tail -2; grep -E " FAILED| ERROR" "$LOGS/tests.log" | cut -c1-200 | head -12
grep -E "^E  " "$LOGS/tests.log" | sort | uniq -c | sort -rn | cut -c1-230 | head -8
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/attention/test_decode_dispatch.py \
    > "$LOGS/tests_dispatch.log" 2>&1
echo "engine GPU attention: exit $?; $(tail -1 "$LOGS/tests_dispatch.log")"

echo "== 2a. kernels on a grid of decode batches (${BENCH_S}s max) =="
timeout "$BENCH_S" "$PY" -m experiments.bench_kernel --backend=gpu --tag="$TAG" --ceilings --upstream \
    --block_size=16 --num_seqs=16,64 --context_len=1024,4096 --num_heads=32,9 --num_kv_heads=8,3 \
    --head_dim=128,64 --dtype=bfloat16 --iters=10 --inner=10 ${BENCH_ARGS:-} > "$LOGS/bench.log" 2>&1
echo "exit $?"; grep -E "^ceilings|^bs=|wrote|Error" "$LOGS/bench.log" | cut -c1-230 | tail -12
echo "== 2b. TritonTuning sweep (${SWEEP_S}s max) =="
timeout "$SWEEP_S" "$PY" -m experiments.bench_kernel --backend=gpu --tag="${TAG}_tunings" --block_size=16 \
    --num_seqs=16,64 --context_len=2048 --num_heads=32,9 --num_kv_heads=8,3 --head_dim=128,64 --dtype=bfloat16 \
    --tunings="$TUNINGS" --prefill_q_len=512 --ceilings --iters=10 --inner=10 ${SWEEP_ARGS:-} > "$LOGS/sweep.log" 2>&1
echo "exit $?"; grep -E "^bs=|prefill|wrote|Error" "$LOGS/sweep.log" | cut -c1-230 | tail -8

echo "== 3. engine end to end (${ENGINE_S}s max each) =="
ENGINE=(-m experiments.attention_backends --model=random:smollm2_135m --seq_buckets=16,64
        --token_buckets=64,256,1024 --rounds=2)
timeout "$ENGINE_S" "$PY" "${ENGINE[@]}" --backends=reference,pallas,xla --dtypes=bfloat16 \
    --output="attention_backends_$TAG" ${ENGINE_ARGS:-} > "$LOGS/engine.log" 2>&1
echo "exit $?"; grep -vE "^\s*$|Warning|warn" "$LOGS/engine.log" | tail -5 | cut -c1-230
timeout "$ENGINE_S" "$PY" "${ENGINE[@]}" --backends=reference,pallas --dtypes=float32 --matmul_precision=highest \
    --output="attention_backends_${TAG}_f32" ${ENGINE_ARGS:-} > "$LOGS/engine_f32.log" 2>&1
echo "exit $?"; grep -vE "^\s*$|Warning|warn" "$LOGS/engine_f32.log" | tail -4 | cut -c1-230

for f in experiments/results/{bench_kernel_"$TAG",bench_kernel_"$TAG"_tunings,attention_backends_"$TAG",attention_backends_"$TAG"_f32}.json; do
  [ -f "$f" ] && cp "$f" "$LOGS"/
done
echo "== summary: kernels vs dense, fraction of bandwidth (bf16) =="
"$PY" - "$TAG" <<'EOF' 2>&1 | tail -30
import json, sys
points, prefill = [], []
for name in (sys.argv[1], sys.argv[1] + "_tunings"):
    try:
        fig = json.load(open(f"experiments/results/bench_kernel_{name}.json"))["figures"]
    except OSError as e:
        print(f"no record: {e}")
        continue
    points += fig["points"]
    prefill += fig.get("prefill_points", [])
for p in points:
    kernels = {k: v for k, v in p.items() if isinstance(v, dict) and "ms" in v}
    ours = [k for k in kernels if k.startswith(("paged_attention", "ragged")) and not k.endswith("_reference")]
    best = min(ours or ["dense"], key=lambda k: kernels[k]["ms"])
    print(f"{p['num_seqs']:>3}x{p['context_len']:<5} h{p['num_heads']}/{p['num_kv_heads']}: dense "
          f"{kernels['dense']['ms']:.4f} ms; ours {kernels.get('paged_attention', {}).get('ms')} ragged "
          f"{kernels.get('ragged_paged_attention', {}).get('ms')} upstream "
          f"{kernels.get('jax_upstream_paged_attention', {}).get('ms')}; best {best} "
          f"{kernels[best]['ms']:.4f} ms = {kernels[best].get('fraction_of_bandwidth')} of bandwidth")
for p in prefill:
    kernels = {k: v for k, v in p.items() if isinstance(v, dict) and "ms" in v}
    best = min((k for k in kernels if k.startswith("ragged_paged_attention@") or k == "ragged_paged_attention")
               or ["dense"], key=lambda k: kernels[k]["ms"])
    print(f"prefill {p['num_seqs']}x{p['q_len']}/{p['context_len']} h{p['num_heads']}: dense "
          f"{kernels['dense']['ms']:.3f} ms; ragged default {kernels.get('ragged_paged_attention', {}).get('ms')}; "
          f"best {best} {kernels[best]['ms']:.3f} ms {kernels[best].get('TFLOP_per_s')} TFLOP/s")
EOF
