"""lm-evaluation-harness (`lm-eval --model local-completions`) against the live server.

A tiny random-weight Llama with SmolLM2's tokenizer (so the test stays fast, and the
tokenizer is a real one) is served on loopback; lm-eval runs two local tasks
(tests/data/lm_eval: no hub access): a multiple-choice task, which it scores by
loglikelihood through `/v1/completions` with `echo: true, logprobs: 1`, and a
generate-until task. Each item's loglikelihood must equal transformers' on the same
weights (within 1e-3), and each generation the engine's own greedy text for that prompt.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
from paged_jax.loading import load_model
from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = os.path.join(REPO, "tests", "data", "lm_eval")
MODEL = "tiny-smollm2-vocab"


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama_smollm2_tokenizer"))
    hf, tokenizer = save_tiny_smollm2_vocab(path)
    engine = LLMEngine(load_model(path), EngineConfig(block_size=8, num_blocks=96, max_model_len=256, max_num_seqs=8,
                                                      max_num_batched_tokens=64, seq_buckets=(8,),
                                                      token_buckets=(8, 64)))
    # the generate-until task's prompts, greedily, before the server owns the engine
    docs = _read_jsonl(os.path.join(TASKS, "generate.jsonl"))
    for i, doc in enumerate(docs):
        engine.add_request(f"gen-{i}", {"prompt_token_ids": tokenizer.encode(doc["prompt"], add_special_tokens=False)},
                           SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))
    offline = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                offline[docs[int(out.request_id.split("-")[1])]["prompt"]] = out.outputs[0].text
    server = BackgroundServer(build_app(engine, ServerSettings(served_model_name=MODEL)))
    yield path, hf, tokenizer, server, offline
    server.stop()


def _hf_loglikelihood(hf, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the pair encoded as lm-eval's TemplateAPI encodes it."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), dim=-1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(n, len(whole))))


@pytest.mark.parametrize("tokenizer_backend", [pytest.param("huggingface", marks=pytest.mark.slow), "remote"])
def test_lm_eval_local_completions(served, tmp_path, tokenizer_backend):
    path, hf, tokenizer, server, offline = served
    model_args = (f"model={MODEL},base_url={server.base_url}/v1/completions,tokenizer_backend={tokenizer_backend},"
                  f"num_concurrent=1,max_retries=1")
    if tokenizer_backend == "huggingface":
        model_args += f",tokenizer={path}"  # a local directory: no hub access
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                             model_args, "--tasks", "paged_jax_mc,paged_jax_generate", "--include_path", TASKS,
                             "--output_path", str(tmp_path), "--log_samples", "--batch_size", "4"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    [results_file] = glob.glob(str(tmp_path / "**" / "results_*.json"), recursive=True)
    results = json.load(open(results_file))["results"]
    assert 0 <= results["paged_jax_mc"]["acc,none"] <= 1
    assert 0 <= results["paged_jax_generate"]["exact_match,none"] <= 1

    [mc_file] = glob.glob(str(tmp_path / "**" / "samples_paged_jax_mc_*.jsonl"), recursive=True)
    mc = _read_jsonl(mc_file)
    assert len(mc) == len(_read_jsonl(os.path.join(TASKS, "multiple_choice.jsonl")))
    scored = 0
    for sample in mc:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            loglikelihood = float(resp[0][0])
            assert loglikelihood == pytest.approx(_hf_loglikelihood(hf, tokenizer, context, continuation), abs=1e-3)
            scored += 1
    assert scored >= 2 * len(mc)

    [gen_file] = glob.glob(str(tmp_path / "**" / "samples_paged_jax_generate_*.jsonl"), recursive=True)
    for sample in _read_jsonl(gen_file):
        assert sample["resps"][0][0] == offline[sample["doc"]["prompt"]]
