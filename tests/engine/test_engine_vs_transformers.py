"""The paged engine against transformers' greedy generate, on the same random weights.

Tiny models built with transformers, saved with save_pretrained and loaded through the
Hugging Face path; a mixed trace runs under a KV budget that forces preemptions. Mistral
with an 8-token sliding window exercises the window through the block tables.
"""

import random

import pytest
import torch
import transformers

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import load_model
from tests.helpers.greedy_check import assert_greedy_match
from tests.helpers.hf_variants import VARIANTS, reinit


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=[], pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("variant", ["mistral_window8", "qwen3_bias"])
def test_engine_greedy_equals_transformers(tmp_path, variant):
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant](), attn_implementation="eager",
                                                       dtype=torch.float32)
    reinit(hf, seed=11)
    hf.eval()
    hf.save_pretrained(str(tmp_path))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 120))] for _ in range(12)]
    max_tokens = [rng.randint(1, 60) for _ in prompts]
    llm = LLM(load_model(str(tmp_path)), block_size=8, num_blocks=40, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, seq_buckets=(2, 8), token_buckets=(16, 64))  # few shapes to compile
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
                        use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, n, out in zip(prompts, max_tokens, outs):
        assert_greedy_match(prompt, _hf_greedy(hf, prompt, n), out.outputs[0].token_ids,
                            lambda ids: _hf_next_logits(hf, ids))
    assert len({tuple(o.outputs[0].token_ids[:5]) for o in outs}) > 3  # outputs are not degenerate
