"""Server pieces that need no engine: streaming text deltas and the engine flags."""

import dataclasses

import pytest
from absl import flags

from paged_jax.entrypoints.engine_flags import define_engine_flags, engine_config_from_flags
from paged_jax.config.engine_config import EngineConfig
from paged_jax.entrypoints.openai.responses import chat_logprobs, completion_logprobs
from paged_jax.entrypoints.openai.text_delta import TextDeltaTracker, partial_stop_len


def test_partial_stop_len():
    assert partial_stop_len("Hello wor", ("world",)) == 3  # "wor" may become "world"
    assert partial_stop_len("Hello world", ("world",)) == 0  # a whole stop is not a proper prefix
    assert partial_stop_len("abc", ("cd", "bcx")) == 2  # the longest over all stops: "bc"
    assert partial_stop_len("abc", ("x",)) == 0  # one-character stops never need holding back
    assert partial_stop_len("", ("ab",)) == 0


def test_deltas_hold_back_unfinished_characters_and_stop_prefixes():
    t = TextDeltaTracker(("STOP",))
    assert t.delta("Hi", False) == "Hi"
    assert t.delta("Hi \ufffd", False) == " "  # half of a multi-byte character: wait for the rest
    assert t.delta("Hi \u00e9", False) == "\u00e9"
    assert t.delta("Hi \u00e9 ST", False) == " "  # "ST" may start "STOP"
    assert t.delta("Hi \u00e9 STA", False) == "STA"  # it did not
    assert t.delta("Hi \u00e9 STA S", False) == " "
    # the engine cut at the stop: the held "S" was never sent, so nothing is taken back
    assert t.delta("Hi \u00e9 STA ", True) == ""
    assert t.sent == "Hi \u00e9 STA "


def test_deltas_flush_everything_when_finished():
    t = TextDeltaTracker(("xyz",))
    assert t.delta("ab\ufffd", False) == "ab"
    assert t.delta("ab\ufffdx", True) == "\ufffdx"  # finished: the text is final, even a lone U+FFFD
    assert t.delta("ab\ufffdx", True) == ""


def test_deltas_concatenate_to_the_final_text():
    final = "The answer is 42. Done"
    t = TextDeltaTracker((". D", "is 4"))
    sent = "".join(t.delta(final[:k], False) for k in range(len(final)))
    assert final.startswith(sent)
    assert sent + t.delta(final, True) == final


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
