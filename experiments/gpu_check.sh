#!/usr/bin/env bash
# The GPU check of the paged-attention kernels and the engine, run unchanged on a machine with
# a CUDA GPU and JAX's CUDA plugin installed (e.g. the lent H200 through the device tool):
#   bash experiments/gpu_check.sh [TAG]
#   STAGES=2c bash experiments/gpu_check.sh [TAG]    # the decode-kernel TritonTuning sweep alone
# Stages, each bounded in time so that one failing stage leaves the others' results:
# 1. the kernel test suites natively on the GPU (`-m gpu`: the same tests run in interpret mode
#    on CPU), including TritonTunings of every kind the sweep below varies, and the engine's
#    GPU attention (decode steps to the decode kernel, the rest to the ragged one);
# 2a. the kernel benchmarks (experiments/bench_kernel.py): the device's memory bandwidth and
#    bf16 matmul rate, then decode kernels vs the jnp reference, dense attention and JAX's own
#    Pallas GPU kernel on a grid of batches (record bench_kernel_<TAG>);
# 2b. a sweep of TritonTunings of both kernels on decode batches of 16 and 64 sequences and on
#    prefill chunks (bench_kernel_<TAG>_tunings), with GB/s and fractions of the ceilings;
# 2c. (not by default) the decode kernel alone, with dense attention, under DECODE_TUNINGS on
#    2a's grid of batches, the largest first (bench_kernel_<TAG>_decode_sweep): what its
#    defaults are chosen from;
# 3. the engine end to end (experiments/attention_backends.py): SmolLM2-135M's shapes with random
#    weights (the real ones are too large to carry), 64 ShareGPT-like requests, the jnp
#    reference vs the Pallas kernels (and the XLA decode loop) in bfloat16: output tok/s and
#    greedy agreement; 3f32: float32 with full-f32 matmuls (GPUs default to TF32), where the
#    outputs must be equal up to near ties.
# Kernel times are medians of ITERS samples of INNER calls chained in one jitted loop
# (experiments/benchmarks/kernel_timing.py: kernels under 0.1 ms are as short as the host's
# dispatch of a call, so calls are not dispatched one by one).
# Results: experiments/results/bench_kernel_<TAG>{,_tunings,_decode_sweep}.json,
# attention_backends_<TAG>{,_f32}.json; under $OUT when the device tool sets it, copies of them
# and logs.tgz (its limit on files coming back). STAGES (default "1 2a 2b 3 3f32") picks the
# stages; the stage limits and sizes are environment variables (TEST_S, BENCH_S, SWEEP_S,
# DECODE_S, ENGINE_S, TEST_WORKERS, ITERS, INNER; TEST_ARGS, BENCH_ARGS, SWEEP_ARGS, DECODE_ARGS,
# ENGINE_ARGS are appended to the commands), so a CPU dry run can shrink them.
# On an H200 (December 2026) stage 1 took 1.6 min, 2a 2, 2b 75 s a batch (compiling: 2 of 4
# in its then 150 s), 3 and 3f32 1-2 each, 2c 1.5 (before calls were chained 10 per loop
# trip, which compiles longer): more than one 10-minute call of the device tool, so there
# run them as two, e.g. STAGES="1 2a 3 3f32" and STAGES=2b.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG="${1:-gpu}"
PY="${PYTHON:-python3}"
LOGS="${OUT:-/tmp/gpu_check_$TAG}"
mkdir -p "$LOGS"
# on demand, not 75% up front: the test stage runs several JAX processes on the one GPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
TEST_S="${TEST_S:-130}" BENCH_S="${BENCH_S:-150}" SWEEP_S="${SWEEP_S:-330}" DECODE_S="${DECODE_S:-240}"
ENGINE_S="${ENGINE_S:-170}" ITERS="${ITERS:-10}" INNER="${INNER:-50}"
STAGES=" ${STAGES:-1 2a 2b 3 3f32} "
run_stage() { [[ "${STAGES//,/ }" == *" $1 "* ]]; }
TEST_WORKERS="${TEST_WORKERS:-6}"  # pytest-xdist processes: the tests' time is compiling, on the CPUs
# The kernels' launch choices the sweeps compare (pallas_kernels/triton_tuning.py labels)
# (labels take TritonTuning's field defaults, 2 stages: c128-s2 is the decode default before
# December 2026 where auto splits agree, c128-k6 where they do not, 16 x 3 kv heads)
TUNINGS="${TUNINGS:-c64-w4,c128-s2,c128-k6,c128-w8-s3,c128-k1,c128-k2,c128-k4,c128-r64,c64-r128,c32-r64,c64-r64-s3}"
DECODE_TUNINGS="${DECODE_TUNINGS:-c64,c64-k2,c64-k4,c64-k8,c64-s3,c64-s4,c128-k1,c128-k2,c128-k4,c128-k8,c128-s3,c128-w8,c32-s4}"
GRID=(--block_size=16 --num_seqs=16,64 --context_len=1024,4096 --num_heads=32,9 --num_kv_heads=8,3 --head_dim=128,64
      --dtype=bfloat16)
keep() {  # copies of the records that exist under $LOGS, where the device tool fetches them
  for name in "$@"; do
    [ -f "experiments/results/$name.json" ] && [ "$LOGS" != "experiments/results" ] && cp "experiments/results/$name.json" "$LOGS"/
  done
  return 0
}

echo "== device =="
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tail -2
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tail -1

if run_stage 1; then
echo "== 1. native kernel tests (${TEST_S}s max) =="
timeout "$TEST_S" "$PY" -m pytest -v -p no:cacheprovider -m gpu -o addopts="" -n "$TEST_WORKERS" tests/kernels \
    ${TEST_ARGS:-} > "$LOGS/tests.log" 2>&1
echo "exit $? (124: timed out); PASSED $(grep -c ' PASSED' "$LOGS/tests.log") FAILED $(grep -c ' FAILED' "$LOGS/tests.log")"
grep -E "passed|failed" "$LOGS/tests.log" | tail -2; grep -E " FAILED| ERROR" "$LOGS/tests.log" | cut -c1-200 | head -12
grep -E "^E  " "$LOGS/tests.log" | sort | uniq -c | sort -rn | cut -c1-230 | head -8
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/attention/test_decode_dispatch.py \
    > "$LOGS/tests_dispatch.log" 2>&1
echo "engine GPU attention: exit $?; $(tail -1 "$LOGS/tests_dispatch.log")"
fi

if run_stage 2a; then
echo "== 2a. kernels on a grid of decode batches (${BENCH_S}s max) =="
timeout "$BENCH_S" "$PY" -m experiments.bench_kernel --backend=gpu --tag="$TAG" --ceilings --upstream "${GRID[@]}" \
    --iters="$ITERS" --inner="$INNER" ${BENCH_ARGS:-} > "$LOGS/bench.log" 2>&1
echo "exit $?"; grep -E "^timing|^ceilings|^bs=|wrote|Error" "$LOGS/bench.log" | cut -c1-230 | tail -12
keep "bench_kernel_$TAG"
fi
if run_stage 2b; then
echo "== 2b. TritonTuning sweep (${SWEEP_S}s max) =="
timeout "$SWEEP_S" "$PY" -m experiments.bench_kernel --backend=gpu --tag="${TAG}_tunings" --block_size=16 \
    --num_seqs=16,64 --context_len=2048 --num_heads=32,9 --num_kv_heads=8,3 --head_dim=128,64 --dtype=bfloat16 \
    --tunings="$TUNINGS" --prefill_q_len=512 --ceilings --iters="$ITERS" --inner="$INNER" ${SWEEP_ARGS:-} \
    > "$LOGS/sweep.log" 2>&1
echo "exit $?"; grep -E "^bs=|prefill|wrote|Error" "$LOGS/sweep.log" | cut -c1-230 | tail -8
keep "bench_kernel_${TAG}_tunings"
fi
if run_stage 2c; then
echo "== 2c. decode kernel TritonTuning sweep (${DECODE_S}s max) =="
timeout "$DECODE_S" "$PY" -m experiments.bench_kernel --backend=gpu --tag="${TAG}_decode_sweep" --ceilings \
    --kernels=paged_attention --tunings="$DECODE_TUNINGS" --block_size=16 --num_seqs=64,16 --context_len=4096,1024 \
    --num_heads=32,9 --num_kv_heads=8,3 --head_dim=128,64 --dtype=bfloat16 --iters="$ITERS" --inner="$INNER" \
    ${DECODE_ARGS:-} > "$LOGS/decode_sweep.log" 2>&1
echo "exit $?"; grep -E "^timing|^ceilings|^bs=|wrote|Error" "$LOGS/decode_sweep.log" | cut -c1-230 | tail -12
keep "bench_kernel_${TAG}_decode_sweep"
fi

ENGINE=(-m experiments.attention_backends --model=random:smollm2_135m --seq_buckets=16,64
        --token_buckets=64,256,1024 --rounds=2)
if run_stage 3; then
echo "== 3. engine end to end, bf16 (${ENGINE_S}s max) =="
timeout "$ENGINE_S" "$PY" "${ENGINE[@]}" --backends=reference,pallas,xla --dtypes=bfloat16 \
    --output="attention_backends_$TAG" ${ENGINE_ARGS:-} > "$LOGS/engine.log" 2>&1
echo "exit $?"; grep -vE "^\s*$|Warning|warn" "$LOGS/engine.log" | tail -5 | cut -c1-230
keep "attention_backends_$TAG"
fi
if run_stage 3f32; then
echo "== 3f32. engine end to end, f32 (${ENGINE_S}s max) =="
timeout "$ENGINE_S" "$PY" "${ENGINE[@]}" --backends=reference,pallas --dtypes=float32 --matmul_precision=highest \
    --output="attention_backends_${TAG}_f32" ${ENGINE_ARGS:-} > "$LOGS/engine_f32.log" 2>&1
echo "exit $?"; grep -vE "^\s*$|Warning|warn" "$LOGS/engine_f32.log" | tail -4 | cut -c1-230
keep "attention_backends_${TAG}_f32"
fi
if [ -n "${OUT:-}" ]; then  # the device tool brings back at most 8 files: the logs as one
  (cd "$LOGS" && ls *.log >/dev/null 2>&1 && tar -czf logs.tgz *.log && rm -f *.log)
fi

echo "== summary: kernels vs dense, fraction of bandwidth (bf16), this run's records =="
RAN=(); run_stage 2a && RAN+=("$TAG"); run_stage 2b && RAN+=("${TAG}_tunings")
run_stage 2c && RAN+=("${TAG}_decode_sweep")
"$PY" - "${RAN[@]}" <<'EOF' 2>&1 | tail -60
import json, sys
for name in sys.argv[1:]:
    try:
        fig = json.load(open(f"experiments/results/bench_kernel_{name}.json"))["figures"]
    except OSError as e:
        print(f"no record: {e}")
        continue
    print(f"-- bench_kernel_{name}: timing {fig.get('timing')}")
    points, prefill = fig["points"], fig.get("prefill_points", [])
    if name.endswith("_decode_sweep"):  # ms per tuning (rows) and batch (columns); ! marks an error > 0.05
        names = ["dense"] + [k for k in points[0] if k.startswith("paged_attention") and isinstance(points[0][k], dict)]
        print(f"{'ms':<22}" + "".join(f"{p['num_seqs']}x{p['context_len']}/{p['num_heads']}".rjust(11) for p in points))
        for k in names:
            cells = [p.get(k, {}) for p in points]
            print(f"{k.replace('paged_attention', 'pa'):<22}" + "".join(
                (f"{c['ms']:.4f}" + ("!" if c.get("max_abs_err_vs_dense", 0) > 0.05 else "")).rjust(11)
                if "ms" in c else "err".rjust(11) for c in cells))
        for p in points:
            ours = {k: v for k, v in p.items() if k.startswith("paged_attention") and isinstance(v, dict) and "ms" in v}
            best = min(ours, key=lambda k: ours[k]["ms"])
            print(f"{p['num_seqs']:>3}x{p['context_len']:<5} h{p['num_heads']}/{p['num_kv_heads']}: default/dense "
                  f"{p.get('paged_attention_over_dense')} ({p.get('paged_attention', {}).get('fraction_of_bandwidth')}"
                  f" of bandwidth); best {best} {ours[best]['ms']:.4f} ms, /dense "
                  f"{ours[best]['ms'] / p['dense']['ms']:.3f}, {ours[best].get('fraction_of_bandwidth')} of bandwidth")
        continue
    for p in points:
        kernels = {k: v for k, v in p.items() if isinstance(v, dict) and "ms" in v}
        ours = [k for k in kernels if k.startswith(("paged_attention", "ragged")) and not k.endswith("_reference")]
        best = min(ours or ["dense"], key=lambda k: kernels[k]["ms"])
        print(f"{p['num_seqs']:>3}x{p['context_len']:<5} h{p['num_heads']}/{p['num_kv_heads']}: dense "
              f"{kernels['dense']['ms']:.4f} ms; ours {kernels.get('paged_attention', {}).get('ms')} (/dense "
              f"{p.get('paged_attention_over_dense')}, {kernels.get('paged_attention', {}).get('fraction_of_bandwidth')}"
              f" of bandwidth) ragged {kernels.get('ragged_paged_attention', {}).get('ms')} upstream "
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
