"""experiments/attention_backends.py: its comparison finds a changed token and scores it
with the ground-truth engine's own logits."""

import numpy as np

from experiments import attention_backends as ab
from experiments.bench_models import load_for_benchmark
from experiments.benchmarks.logits_capture import next_token_logits
from experiments.benchmarks.workloads import make_trace
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM


def test_a_changed_token_is_a_mismatch_with_the_reference_logit_gap():
    loaded = load_for_benchmark("random:tiny_llama", ab.MAX_MODEL_LEN)
    requests = make_trace("sharegpt", 2, seed=0, scale=0.05, max_model_len=128, vocab_size=loaded.config.vocab_size)
    llm = LLM(loaded, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64,
              attention_backend="reference", seq_buckets=(4,), token_buckets=(64,))
    outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    reference = [list(o.outputs[0].token_ids) for o in outs]
    # request 1's token 3 replaced by the token the reference likes least there
    prefix = list(requests[1].prompt_token_ids) + reference[1][:3]
    logits, greedy = next_token_logits(llm, prefix)
    assert greedy == reference[1][3]
    worst = int(np.argmin(logits))
    candidate = [reference[0], reference[1][:3] + [worst] + reference[1][4:]]
    found = ab.compare(llm, requests, reference, candidate, tie_tolerance=1e-3)
    assert (found["identical"], found["near_ties"], found["mismatches"]) == (1, 0, 1)
    [row] = found["differences"]
    assert (row["request"], row["position"], row["candidate_token"]) == (1, 3, worst)
    assert row["reference_logit_gap"] == round(float(logits[greedy] - logits[worst]), 6) > 1e-3
    # the same output is no difference at all; a shorter one differs in length
    assert ab.compare(llm, requests, reference, reference, tie_tolerance=1e-3)["identical"] == 2
    short = ab.compare(llm, requests, reference, [reference[0], reference[1][:2]], tie_tolerance=1e-3)
    assert short["differences"][0]["length_differs"] and short["mismatches"] == 1
