"""LLM / LLMEngine behaviour: bad input, aborts, seeds, stops, logprobs, n."""

import jax
import numpy as np
import pytest

import configs
from paged_jax.baselines import reference
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.engine.llm_engine import LLMEngine, completion_seed
from paged_jax.loading import LoadedModel
from paged_jax.model.llama import init_params

SETTINGS = dict(block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                seq_buckets=(1, 4), token_buckets=(8, 32))  # few shapes to compile


@pytest.fixture(scope="module")
def model():
    cfg = configs.get_config("tiny_qwen3")
    return LoadedModel(cfg, init_params(cfg, jax.random.key(3)), None, "memory", "memory", 0.0)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, **SETTINGS)


def _ids(*prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _idle_and_clean(llm):
    engine = llm.engine
    engine.block_manager.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": list(range(3, 67))}, SamplingParams(), "at most 63 tokens"),
    ({"prompt_token_ids": [1, 999]}, SamplingParams(), "outside the vocabulary"),
    ("text", SamplingParams(), "no tokenizer"),
    ({"tokens": [1]}, SamplingParams(), "prompt_token_ids"),
])
def test_bad_prompts_are_refused_and_the_engine_stays_usable(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6]}, prompt], params, use_tqdm=False)
    _idle_and_clean(llm)  # nothing from the refused batch was queued
    [out] = llm.generate(_ids([5, 6]), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(n=0), "n must be"),
    (dict(min_p=2.0), "min_p"), (dict(seed=-1), "seed"),
    # NaN passes every comparison (it used to act as greedy); top_k reaches an i32 array
    (dict(temperature=float("nan")), "temperature must be a finite"), (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("inf")), "min_p"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=2**31), "top_k"), (dict(top_k=10**30), "top_k"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature=1e39), "float32"),  # finite here, inf in the step's f32 array
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [8], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    _idle_and_clean(llm)


def test_kv_budget_too_small_names_the_largest_max_model_len(model):
    # 9 blocks of 4 tokens = 8 usable (watermark int(0.01*8) = 0): 32 tokens fit, 64 do not
    with pytest.raises(ValueError, match="largest max_model_len that fits is 32"):
        LLMEngine(model, EngineConfig(block_size=4, num_blocks=9, max_model_len=64, max_num_seqs=4,
                                      max_num_batched_tokens=32))


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_usable_blocks
    engine.abort_request("long")
    _idle_and_clean(llm)


def test_seeded_sampling_equals_reference_alone_and_in_a_batch(llm, model):
    prompts = [[5, 9, 13], list(range(3, 30)), [77]]
    seeds = [11, 12, 13]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in seeds]
    batch = llm.generate(_ids(*prompts), params, use_tqdm=False)
    # the engine derives completion 0's stream from the request seed exactly as the reference does
    want = reference.generate(model.params, model.config, prompts, max_new_tokens=12, temperature=0.8, top_p=0.9,
                              seeds=[completion_seed(s, 0) for s in seeds],
                              ignore_eos=True)
    for out, w in zip(batch, want):
        assert out.outputs[0].token_ids == w
    alone = llm.generate(_ids(prompts[1]), params[1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == batch[1].outputs[0].token_ids


def test_n_completions(llm):
    [greedy] = llm.generate(_ids([5, 6, 7]), SamplingParams(n=3, temperature=0, max_tokens=6), use_tqdm=False)
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    [sampled] = llm.generate(_ids([5, 6, 7]), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                              ignore_eos=True), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1  # each completion has its own stream
    [again] = llm.generate(_ids([5, 6, 7]), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                            ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in sampled.outputs]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_generate_builds_final_outputs_only_whatever_the_kind_asked(llm, kind):
    """LLM.generate returns finished requests only, so the engine builds no output for a
    running one (a CUMULATIVE output copies the whole completion); the answers are the
    same whichever kind the caller's params named."""
    steps = []
    step = llm.engine.step

    def recording_step():
        outputs = step()
        steps.append(outputs)
        return outputs

    llm.engine.step = recording_step
    try:
        outs = llm.generate(_ids([5, 6, 7], [8, 9]), SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True,
                                                                    logprobs=0, output_kind=kind), use_tqdm=False)
    finally:
        del llm.engine.step
    assert len(steps) >= 5 and all(o.finished for outputs in steps for o in outputs)
    assert sum(len(outputs) for outputs in steps) == 2
    want = llm.generate(_ids([5, 6, 7], [8, 9]), SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True,
                                                                logprobs=0), use_tqdm=False)
    for out, w in zip(outs, want):
        assert [(c.token_ids, c.logprobs) for c in out.outputs] == [(c.token_ids, c.logprobs) for c in w.outputs]
        assert all(len(c.token_ids) == 5 for c in out.outputs)


def test_stop_token_ids_and_logprobs(llm, model):
    [free] = llm.generate(_ids([5, 6, 7]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                           logprobs=0), use_tqdm=False)
    tokens = free.outputs[0].token_ids
    stop = tokens[4]
    [stopped] = llm.generate(_ids([5, 6, 7]), SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]),
                             use_tqdm=False)
    assert stopped.outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    # logprobs of greedy picks are the reference's log-softmax at the chosen tokens
    ids = [5, 6, 7] + tokens
    logits = reference.prompt_logits(model.params, model.config, [ids])[0]
    log_softmax = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = [log_softmax[2 + i, t] for i, t in enumerate(tokens)]
    np.testing.assert_allclose(free.outputs[0].logprobs, want, atol=1e-4)


def test_top_logprobs_match_the_reference_in_a_batch_where_only_one_request_asks(llm, model):
    """The runner computes top-K only in steps where a row asks; the row that asks gets the
    reference's K best log-softmax entries at every position, the others none."""
    asks = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    asked, other = llm.generate(_ids([5, 6, 7], [9, 10]), [asks, plain], use_tqdm=False)
    assert other.outputs[0].top_logprobs is None
    tokens = asked.outputs[0].token_ids
    logits = reference.prompt_logits(model.params, model.config, [[5, 6, 7] + tokens])[0]
    log_softmax = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    for i, top in enumerate(asked.outputs[0].top_logprobs):
        row = np.asarray(log_softmax[2 + i])
        want = np.argsort(-row)[:3]
        assert [t for t, _ in top] == want.tolist(), i
        np.testing.assert_allclose([lp for _, lp in top], row[want], atol=1e-4)


def test_a_sequence_may_fill_max_model_len_and_not_more(llm):
    """60 prompt tokens + 4 == max_model_len 64: runs to the end of the context; asking for
    50 is refused (it used to be cut to 4, silently)."""
    with pytest.raises(ValueError, match="maximum context length is 64 tokens.*110 tokens"):
        llm.generate(_ids(list(range(3, 63))), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                     use_tqdm=False)
    [out] = llm.generate(_ids(list(range(3, 63))), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"  # 60 + 4 = 64
    _idle_and_clean(llm)
