"""A completion's logprobs do not depend on its batch neighbours.

The runner computes logprobs only for a batch in which some row asked for them; in other
batches its logprob slot holds the token's raw logit. So the engine core reports logprobs
(per token and cumulative) only to completions that asked for them, as vLLM does (None
otherwise), and a completion that asked gets log-probabilities, whoever shares its steps.
"""

import math

import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.engine_core import EngineCore

SETTINGS = dict(block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                seq_buckets=(4,), token_buckets=(32,))  # one shape to compile
PROMPT, NEIGHBOUR = [5, 6, 7, 8], [9, 10, 11]


@pytest.fixture(scope="module")
def core(tiny_llama):
    return EngineCore(tiny_llama.config, tiny_llama.params, EngineConfig(**SETTINGS))


def _deltas(core, requests) -> dict[str, list]:
    for request_id, prompt, params in requests:
        core.add_request(request_id, prompt, params)
    deltas = {request_id: [] for request_id, _, _ in requests}
    while core.has_unfinished_requests():
        for out in core.step():
            deltas[out.request_id] += out.completions
    return deltas


def test_a_completion_without_logprobs_reports_the_same_alone_and_beside_one_with_them(core):
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    asking = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    alone = _deltas(core, [("alone", PROMPT, plain)])["alone"]
    beside = _deltas(core, [("plain", PROMPT, plain), ("asking", NEIGHBOUR, asking)])
    seen = lambda deltas: [(d.new_token_ids, d.new_logprobs, d.cumulative_logprob) for d in deltas]
    assert seen(alone) == seen(beside["plain"])
    assert all(d.new_logprobs is None and d.cumulative_logprob is None for d in alone)
    # the neighbour's figures are log-probabilities: <= 0, cumulative = the running sum
    total = 0.0
    for d in beside["asking"]:
        [logprob] = d.new_logprobs
        total += logprob
        assert logprob <= 0.0 and math.isclose(d.cumulative_logprob, total, rel_tol=1e-6)


def test_logprobs_asked_alone_are_log_probabilities(core):
    """The same greedy request asking for logprobs, alone (the runner computes them for
    its batch): the values are the ones it got beside a request that did not ask."""
    asking = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = _deltas(core, [("alone", PROMPT, asking)])["alone"]
    beside = _deltas(core, [("asking", PROMPT, asking), ("plain", NEIGHBOUR, plain)])["asking"]
    assert [d.new_token_ids for d in alone] == [d.new_token_ids for d in beside]
    for a, b in zip(alone, beside):
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)
        assert a.cumulative_logprob <= 0.0
