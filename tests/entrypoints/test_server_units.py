"""Server pieces that need no engine: streaming text deltas and offsets, logprob bodies, the engine flags."""

import dataclasses
import json

import pydantic
import pytest
from absl import flags

from paged_jax.entrypoints.engine_flags import define_engine_flags, engine_config_from_flags
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.entrypoints.openai.errors import validation_message
from paged_jax.entrypoints.openai.json_body import parse_json_body
from paged_jax.entrypoints.openai.protocol import CompletionRequest
from paged_jax.entrypoints.openai.responses import ResponseBuilder, chat_logprobs, completion_logprobs


class _PieceTokenizer:
    """Token id -> a fixed piece of text (no `tokenizers` backend: the detokenizer's window path)."""

    PIECES = {5: "Hi", 6: " S", 7: "T", 8: "A", 9: "R", 10: "!", 11: "O", 12: "P"}

    def decode(self, token_ids, skip_special_tokens=True, **kwargs):
        return "".join(self.PIECES[t] for t in token_ids)


def _stream(token_ids, stops):
    """Feed one completion's tokens, one per step, through the engine's output processor
    (DELTA outputs, as the server streams) and a streaming completions ResponseBuilder;
    returns the chunks' bodies and the non-streamed body of the same steps' final output."""
    tokenizer = _PieceTokenizer()
    processor = OutputProcessor(tokenizer)
    whole_processor = OutputProcessor(tokenizer)
    for p, kind in ((processor, RequestOutputKind.DELTA), (whole_processor, RequestOutputKind.FINAL_ONLY)):
        p.add_request("e0", None, [1], SamplingParams(max_tokens=len(token_ids), stop=stops, logprobs=0,
                                                      output_kind=kind))
    builder = ResponseBuilder(chat=False, request_id="cmpl-1", model="m", engine_ids=["e0"], n=1,
                              tokenizer=tokenizer, logprobs=0)  # as app.py builds it
    bodies = []
    for step, token in enumerate(token_ids):
        last = step == len(token_ids) - 1
        delta = CompletionDelta(0, [token], [-0.5], None, -0.5 * (step + 1), "length" if last else None)
        core = EngineCoreOutput("e0", [delta], last, float(step), 0.0, 0.0, 0)
        [out] = processor.process([core]).request_outputs
        final = whole_processor.process([core]).request_outputs
        bodies += [json.loads(c.removeprefix("data: ")) for c in builder.chunks(out)]
        if out.finished:
            [out] = final
            break
    whole = ResponseBuilder(chat=False, request_id="cmpl-2", model="m", engine_ids=["e0"], n=1,
                            tokenizer=tokenizer, logprobs=0).response([out])
    return bodies, whole


@pytest.mark.parametrize("token_ids, final_text", [
    ([5, 6, 7, 8, 9, 10], "Hi STAR!"),  # " S", " ST" are held back as a possible "STOP", then released
    ([5, 6, 7, 11, 12, 10], "Hi "),  # ... and here it was one: the text is cut before it
])
def test_streamed_text_offsets_stay_right_while_text_is_held_back(token_ids, final_text):
    bodies, whole = _stream(token_ids, ("STOP",))
    choices = [b["choices"][0] for b in bodies]
    assert "".join(c["text"] for c in choices) == final_text == whole.choices[0].text
    assert any(c["logprobs"]["tokens"] and not c["text"] for c in choices)  # some text was held back
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    pieces = [_PieceTokenizer.PIECES[t] for t in token_ids[:len(tokens)]]
    assert tokens == pieces
    # each token's offset is where its text starts among the completion's tokens, as in the whole response
    assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_every_engine_config_field_is_a_flag():
    values = flags.FlagValues()
    names = define_engine_flags(flag_values=values)
    assert names == [f.name for f in dataclasses.fields(EngineConfig)]  # new fields are picked up
    values(["prog", "--block_size=32", "--num_blocks=99", "--preemption_mode=swap", "--seq_buckets=2,8",
            "--watermark=0.05"] + (["--noenable_prefix_caching"] if "enable_prefix_caching" in names else []))
    config = engine_config_from_flags(values, max_num_seqs=8, max_num_batched_tokens=64)
    assert (config.block_size, config.num_blocks, config.preemption_mode, config.seq_buckets, config.watermark,
            config.max_num_seqs) == (32, 99, "swap", (2, 8), 0.05, 8)
    if "enable_prefix_caching" in names:
        assert config.enable_prefix_caching is False
    assert "tokens per KV block" in values["block_size"].help  # the field's comment is the help text
    defaults = flags.FlagValues()
    define_engine_flags(flag_values=defaults)
    defaults(["prog"])
    assert engine_config_from_flags(defaults) == EngineConfig()
    values(["prog", "--preemption_mode=never"])
    with pytest.raises(ValueError, match="preemption_mode"):
        engine_config_from_flags(values)


def test_logprobs_bodies():
    text = {5: "a", 6: "bc", 7: "d"}.__getitem__
    # an engine without alternatives: top_logprobs holds the sampled token only
    lp = completion_logprobs(text, [5, 6], [-0.5, -1.5], None, 1, offset=3)
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (["a", "bc"], [-0.5, -1.5], [3, 4])
    assert lp.top_logprobs == [{"a": -0.5}, {"bc": -1.5}]
    assert completion_logprobs(text, [5], [-0.5], None, 0).top_logprobs is None
    # the engine's alternatives, best first, cut to k
    tops = [[(7, -0.1), (5, -0.5), (6, -3.0)], [(6, -1.5), (7, -2.0), (5, -4.0)]]
    assert completion_logprobs(text, [5, 6], [-0.5, -1.5], tops, 2).top_logprobs == [{"d": -0.1, "a": -0.5},
                                                                                    {"bc": -1.5, "d": -2.0}]
    chat = chat_logprobs(text, [5, 6], [-0.5, -1.5], tops, 1).content
    assert [(e.token, e.logprob, e.bytes) for e in chat] == [("a", -0.5, [97]), ("bc", -1.5, [98, 99])]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in chat] == [[("d", -0.1)], [("bc", -1.5)]]
    assert [e.top_logprobs for e in chat_logprobs(text, [5], [-0.5], None, 0).content] == [[]]


@pytest.mark.parametrize("prompt", ["[true, 5]", "[[5, 6], [false]]"])
def test_bools_in_token_id_prompts_are_refused_not_coerced(prompt):
    """JSON true is not a token id: the strict request model refuses it (parse_body's 400
    naming the field) rather than coercing it to 1; the engine's own check is
    tests/engine/test_processor.py's."""
    data = parse_json_body(f'{{"model": "m", "prompt": {prompt}, "max_tokens": 2}}'.encode())
    with pytest.raises(pydantic.ValidationError) as caught:
        CompletionRequest.model_validate(data)
    errors = caught.value.errors()
    assert validation_message(errors)[1] == "prompt"
    assert any(e["type"] == "int_type" and type(e["input"]) is bool for e in errors)  # refused as not an int
    assert CompletionRequest.model_validate({**data, "prompt": [1, 5]}).prompt == [1, 5]
