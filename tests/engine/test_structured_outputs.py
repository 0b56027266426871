"""Structured outputs in the engine: every output of a seeded sampled batch satisfies its
constraint (checked by the regex, the choice list, a JSON parse and the schema's own
rules: never by comparing outputs with themselves), under preemption by recompute and by
swap and with prefix caching, with n > 1; a finished constraint stops the completion;
invalid schemas are refused with llguidance's message before anything is queued.

The model is a tiny random-weight Llama with SmolLM2's tokenizer: a random model wants
arbitrary tokens, so a constraint that holds on its outputs holds because of the mask.
"""

import json
import logging
import re

import numpy as np
import pytest

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.structured_outputs import StructuredOutputsParams
from paged_jax.engine.grammar_matchers import StructuredOutputManager
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import load_model
from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-z]{2}(!|\?)"
CHOICES = ["red", "green", "blue", "dark blue"]


def _satisfies_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 6
            and isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in ("a", "b", "c") for t in value["tags"]))


CASES = {  # name -> (constraint, check of one finished output's text)
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _satisfies_schema),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
                lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t) is not None),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_smollm2_vocab"))
    save_tiny_smollm2_vocab(path)
    return path


def _llm(model_dir, **settings):
    config = dict(block_size=8, num_blocks=160, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                  seq_buckets=(8,), token_buckets=(8, 32))
    return LLM(load_model(model_dir), **{**config, **settings})


def _requests():
    prompts = ["Answer: ", "The data, as JSON or otherwise, is", "Q: pick one.\nA:",
               "A longer prompt, whose first blocks fill up, so that a later request can find them cached: go"]
    out = []
    for i, name in enumerate(CASES):
        for j, prompt in enumerate(prompts):
            out.append((name, prompt, SamplingParams(n=2, temperature=1.0, seed=10 * i + j, max_tokens=48,
                                                     structured_outputs=CASES[name][0])))
    return out


def _check(outs, requests):
    finished = 0
    for (name, _, _), out in zip(requests, outs):
        for c in out.outputs:
            if c.finish_reason == "stop":  # a constraint completed (or EOS where the grammar allows it)
                assert CASES[name][1](c.text), (name, c.text)
                finished += 1
            else:  # cut by max_tokens: still a prefix of something the constraint accepts
                assert c.finish_reason == "length" and len(c.token_ids) == 48, (name, c.text)
    return finished


def test_constraints_hold_on_every_sampled_output(model_dir):
    llm = _llm(model_dir)
    requests = _requests()
    outs = llm.generate([p for _, p, _ in requests], [sp for _, _, sp in requests], use_tqdm=False)
    assert _check(outs, requests) >= 0.8 * 2 * len(requests)
    assert llm.engine.core.structured_outputs.num_matchers == 0  # dropped with their requests
    free = llm.generate(["Answer: "], SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert not re.fullmatch(REGEX, free) and free not in CHOICES  # without a constraint the model rambles


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_keep_the_outputs(model_dir, preemption_mode):
    """The same seeded requests with plenty of blocks and with so few that sequences are
    preempted (recompute replays the prompt and output, swap restores them; the matcher
    waits): equal outputs."""
    requests = _requests()
    prompts, params = [p for _, p, _ in requests], [sp for _, _, sp in requests]
    roomy = _llm(model_dir).generate(prompts, params, use_tqdm=False)
    tight = _llm(model_dir, num_blocks=22, max_model_len=128, preemption_mode=preemption_mode)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in roomy]
    _check(outs, requests)


def test_a_prefix_cache_hit_keeps_the_outputs(model_dir):
    llm = _llm(model_dir)
    long = [(i, r) for i, r in enumerate(_requests()) if r[1].startswith("A longer prompt")]
    first = llm.generate([r[1] for _, r in long], [r[2] for _, r in long], use_tqdm=False)
    again = llm.generate([r[1] for _, r in long], [r[2] for _, r in long], use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in first]


def test_greedy_choice_and_a_finished_grammar_stops(model_dir):
    llm = _llm(model_dir)
    [out] = llm.generate(["Colour:"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                     structured_outputs=CASES["choice"][0]), use_tqdm=False)
    assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"


def test_a_failed_matcher_ends_its_completion_as_an_error_not_a_stop(model_dir, monkeypatch, caplog):
    """Matchers forced into their error state: each step's mask is computed (the matchers
    exist and follow the completions) but not applied, as by a runner that failed to apply
    it, so the random model samples tokens the choice refuses. Such a completion must end
    with finish reason "error" (logged with llguidance's message), never as a normal
    "stop" that a client would take for a finished answer; its matcher is dropped."""
    compute = StructuredOutputManager.bitmask

    def computed_but_not_applied(self, chunks, seqs):
        mask = compute(self, chunks, seqs)
        return None if mask is None else np.full_like(mask, -1)

    monkeypatch.setattr(StructuredOutputManager, "bitmask", computed_but_not_applied)
    llm = _llm(model_dir)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                            structured_outputs=CASES["choice"][0])
    with caplog.at_level(logging.ERROR, logger="paged_jax.engine.grammar_matchers"):
        [out] = llm.generate(["Colour:"], params, use_tqdm=False)
    assert [c.finish_reason for c in out.outputs] == ["error", "error"], [c.text for c in out.outputs]
    assert all(c.text not in CHOICES for c in out.outputs)
    assert sum("grammar matcher" in r.getMessage() for r in caplog.records) == 2
    assert llm.engine.core.structured_outputs.num_matchers == 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_invalid_constraints_are_refused_before_queueing(model_dir):
    llm = _llm(model_dir)
    bad = [StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="root ::= ("),
           StructuredOutputsParams(json={"type": "integer", "minimum": 3, "maximum": 1}),
           StructuredOutputsParams(json="{not json")]
    for so in bad:
        with pytest.raises(ValueError, match="invalid structured_outputs"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    for kwargs in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": "abc"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**kwargs)


def test_an_engine_without_a_tokenizer_refuses_constraints(tiny_llama):
    llm = LLM(tiny_llama, block_size=8, num_blocks=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              seq_buckets=(2,), token_buckets=(16,))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(structured_outputs=CASES["regex"][0]),
                     use_tqdm=False)
