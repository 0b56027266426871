#!/usr/bin/env bash
# The engine's throughput on a GPU, unattended (experiments/gpu_bench.py says what each figure is):
#   bash experiments/gpu_bench.sh [TAG]                 # every stage; TAG names the records (e.g. h100)
#   STAGES="smollm2 peer" bash experiments/gpu_bench.sh h100
#   DRY_RUN=1 bash experiments/gpu_bench.sh dry         # on CPU: tiny shapes, a handful of requests
# Stages, each a process bounded in time (a stage cut short keeps the parts its record already holds:
# gpu_bench.py writes it after each part), in the order run:
#   smollm2  SmolLM2-135M's shapes, random bf16 weights: 512 ShareGPT-like requests through the engine
#            with the platform's defaults (256 sequences, 8192 tokens per step, KV cache from free device
#            memory, async scheduling), output tok/s; then a decode window of 256 sequences: wall ms per
#            step, the device's busy fraction from a profiler trace, the decode roofline (weights + K/V
#            bytes over the measured bandwidth, matmul FLOPs over the measured bf16 rate)
#            -> gpu_bench_<TAG>_smollm2_135m
#   qwen3    the same for Qwen3-0.6B's shapes (q/k norm, tied 151,936-token head) -> gpu_bench_<TAG>_qwen3_0_6b
#   llama8b  the same for Llama-3.1-8B's shapes -> gpu_bench_<TAG>_llama3_1_8b
#   peer     Hugging Face transformers' continuous batching on the same trace, GPU and shapes as the
#            smollm2 stage (its own random weights), and paged_jax's ratio to it -> gpu_bench_<TAG>_peer_hf
#   f32      greedy equality in float32 with full-f32 matmuls on SmolLM2's shapes: the Pallas engine
#            against the jnp reference, token for token up to checked near-ties
#            (experiments/attention_backends.py) -> attention_backends_<TAG>_bench_f32
# Results: experiments/results/<record>.json (under $OUT in a dry run, never in experiments/results);
# under $OUT when the device tool sets it, copies of them and logs.tgz. STAGES (default
# "smollm2 qwen3 llama8b peer f32") picks stages; the limits are SMOLLM2_S, QWEN3_S, LLAMA8B_S, PEER_S,
# F32_S (seconds: 480 in all, this script's budget on one lent GPU call, with no GPU figures yet to
# size them by: where a stage is cut, run it alone in a second call with a larger limit), and
# BENCH_ARGS, PEER_ARGS, F32_ARGS are appended to the commands.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG="${1:-gpu}"
PY="${PYTHON:-python3}"
LOGS="${OUT:-/tmp/gpu_bench_$TAG}"
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# sized from the H200's records (attention_backends_h200*: about 1.5 s to compile a bf16 step program, a
# minute and a half for f32's two engines) and guesses where no GPU has run (the 8B model, transformers)
SMOLLM2_S="${SMOLLM2_S:-100}" QWEN3_S="${QWEN3_S:-80}" LLAMA8B_S="${LLAMA8B_S:-120}" PEER_S="${PEER_S:-80}"
F32_S="${F32_S:-100}"
STAGES=" ${STAGES:-smollm2 qwen3 llama8b peer f32} "
run_stage() { [[ "${STAGES//,/ }" == *" $1 "* ]]; }
declare -A PRESET=([smollm2]=smollm2_135m [qwen3]=qwen3_0_6b [llama8b]=llama3_1_8b)
if [ -n "${DRY_RUN:-}" ]; then  # tiny presets of the same architectures; records stay out of experiments/results
  PRESET=([smollm2]=tiny_llama [qwen3]=tiny_qwen3 [llama8b]=tiny_llama_untied)
  RESULTS="$LOGS"
  SIZES=(--num_requests=6 --scale=0.05 --max_model_len=128 --max_num_seqs=4 --max_num_batched_tokens=32
         --kv_cache_mib=4 --window_steps=3 --bandwidth_mib=4 --matmul_size=128)
  PEER_SIZES=(--num_requests=6 --scale=0.05 --max_model_len=128 --hf_num_blocks=8)
  F32=(--model=tiny_llama --backends=reference,xla --num_requests=3 --max_output_tokens=4 --max_num_seqs=4
       --max_num_batched_tokens=32 --seq_buckets=4 --token_buckets=32 --kv_cache_gib=0.01 --rounds=1)
else
  RESULTS=experiments/results
  SIZES=() PEER_SIZES=()
  # the equality check, not the defaults' throughput: two step programs per engine (64 rows; 64 or 1024 tokens)
  F32=(--model=random:smollm2_135m --backends=reference,pallas --num_requests=32 --max_num_seqs=64
       --max_num_batched_tokens=1024 --seq_buckets=64 --token_buckets=64,1024 --rounds=1)
fi
keep() {  # copies of the records that exist, under $LOGS, where the device tool fetches them
  for name in "$@"; do
    [ -f "$RESULTS/$name.json" ] && [ "$RESULTS" != "$LOGS" ] && cp "$RESULTS/$name.json" "$LOGS"/
  done
  return 0
}

echo "== device =="
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tail -2
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tail -1

RAN=()
for stage in smollm2 qwen3 llama8b; do
  run_stage "$stage" || continue
  limit_var="${stage^^}_S"
  name="gpu_bench_${TAG}_${PRESET[$stage]}"
  echo "== $stage: ${PRESET[$stage]} (${!limit_var}s max) =="
  timeout "${!limit_var}" "$PY" -m experiments.gpu_bench --model="${PRESET[$stage]}" --output="$name" \
      --results_dir="$RESULTS" "${SIZES[@]}" ${BENCH_ARGS:-} > "$LOGS/$stage.log" 2>&1
  echo "exit $? (124: timed out)"; grep -E "^${PRESET[$stage]}:|Error|error" "$LOGS/$stage.log" | cut -c1-300 | tail -6
  keep "$name"; RAN+=("$name")
done
if run_stage peer; then
  name="gpu_bench_${TAG}_peer_hf"
  echo "== peer: transformers continuous batching, ${PRESET[smollm2]} (${PEER_S}s max) =="
  # JAX only writes the record's environment here: no preallocation, torch needs the memory
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$PEER_S" "$PY" -m experiments.gpu_bench --engine=hf_continuous \
      --model="${PRESET[smollm2]}" --against="gpu_bench_${TAG}_${PRESET[smollm2]}" --output="$name" \
      --results_dir="$RESULTS" "${PEER_SIZES[@]}" ${PEER_ARGS:-} > "$LOGS/peer.log" 2>&1
  echo "exit $? (124: timed out)"; grep -E "^hf continuous|Error" "$LOGS/peer.log" | cut -c1-300 | tail -4
  keep "$name"; RAN+=("$name")
fi
if run_stage f32; then
  name="attention_backends_${TAG}_bench_f32"
  echo "== f32: greedy equality with the reference, highest matmul precision (${F32_S}s max) =="
  timeout "$F32_S" "$PY" -m experiments.attention_backends "${F32[@]}" --dtypes=float32 --matmul_precision=highest \
      --output="$name" ${F32_ARGS:-} > "$LOGS/f32.log" 2>&1
  echo "exit $? (124: timed out)"; grep -vE "^\s*$|Warning|warn" "$LOGS/f32.log" | tail -4 | cut -c1-230
  # attention_backends writes only into experiments/results: a dry run's record moves out of it
  [ "$RESULTS" != experiments/results ] && [ -f "experiments/results/$name.json" ] \
      && mv "experiments/results/$name.json" "$RESULTS/"
  keep "$name"; RAN+=("$name")
fi
if [ -n "${OUT:-}" ]; then  # the device tool brings back at most 8 files: the logs as one
  (cd "$LOGS" && ls *.log >/dev/null 2>&1 && tar -czf logs.tgz *.log && rm -f *.log)
fi

echo "== summary: this run's records =="
"$PY" -m experiments.gpu_bench_summary "$RESULTS" "${RAN[@]}" 2>&1 | tail -30
