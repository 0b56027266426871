"""The front end's output processing on real tokenizers: incremental text and stop strings.

Token ids are fed one per step as the engine core would report them; every expected text
comes from the tokenizer's own `decode` of the tokens (or a slice of it), never from the
code under test. Checked: stop strings split across tokens, the earliest of several stop
strings wins, a possible stop is held back and released, what is shown at every step is a
prefix of the final text (also with multi-byte characters and with a tokenizer that
cleans up spaces), and the work per step does not grow with the output's length.
"""

import random
import statistics
import time

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.engine.detokenizer import Detokenizer
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.stop_strings import earliest_stop, partial_stop_len
from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer

TEXT = "The capital of France is Paris. It is a city of light."
MULTIBYTE = "Naïve café — 日本語 🎉 done"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


class _NoBackend:
    """A tokenizer without a `tokenizers` backend (the detokenizer's fallback path), counting
    the tokens its `decode` is asked for."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decoded = 0

    def decode(self, token_ids, **kwargs):
        self.decoded += len(token_ids)
        return self._tokenizer.decode(token_ids, **kwargs)


def _feed(tokenizer, token_ids, stops=None, last=("length", None)):
    """One completion through an OutputProcessor, a token per step, until it finishes.
    Returns the text shown after each step, the final output and what was to be finished
    in the core (request id, index, stop string) per step."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=len(token_ids), stop=stops))
    shown, stopped = [], []
    for step, token in enumerate(token_ids):
        finish, reason = last if step == len(token_ids) - 1 else (None, None)
        delta = CompletionDelta(0, [token], [-1.0], None, -1.0 * (step + 1), finish, reason)
        result = processor.process([EngineCoreOutput("r", [delta], finish is not None, float(step), 0.0, 0.0, 0)])
        [out] = result.request_outputs
        shown.append(out.outputs[0].text)
        stopped.append(result.stopped)
        if out.finished:
            return shown, out, stopped
    raise AssertionError("the request did not finish")


def _assert_prefixes(shown, final):
    for earlier, later in zip(shown, shown[1:] + [final]):
        assert later.startswith(earlier), (earlier, later)


def _first_step_containing(tok, ids, s):
    return next(k for k in range(len(ids)) if s in tok.decode(ids[:k + 1], skip_special_tokens=True))


def test_partial_stop_len_and_earliest_stop():
    assert partial_stop_len("Hello wor", ("world",)) == 3  # "wor" may become "world"
    assert partial_stop_len("Hello world", ("world",)) == 0  # a whole stop is not a proper prefix
    assert partial_stop_len("abc", ("cd", "bcx")) == 2  # the longest over all stops: "bc"
    assert partial_stop_len("abc", ("x",)) == 0  # one-character stops never need holding back
    assert partial_stop_len("", ("ab",)) == 0
    assert earliest_stop("xx ab cd", 0, ("cd", "ab")) == (3, "ab")
    assert earliest_stop("ab abc", 3, ("abc", "ab")) == (3, "ab")  # the one that ended first
    assert earliest_stop("ab abc", 6, ("ab",)) is None  # matches ending before new_from were seen before


def test_a_stop_string_split_across_tokens_ends_the_completion_where_it_completes(tok):
    ids = tok.encode(TEXT)
    stop = "ital of Fr"  # starts inside " capital", ends inside " France"
    shown, out, stopped = _feed(tok, ids, (stop,))
    k = _first_step_containing(tok, ids, stop)
    assert k >= 2 and len(shown) == k + 1  # finished at the token completing it, not before or after
    c = out.outputs[0]
    assert c.text == TEXT[:TEXT.index(stop)] and c.token_ids == ids[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert stopped[k] == [("r", 0, stop)] and not any(stopped[:k])  # the core is told to finish it, once
    _assert_prefixes(shown, c.text)


@pytest.mark.parametrize("stops, first", [
    (("Paris", "capital"), "capital"),  # the later-listed one occurs first
    (("Paris", "is Paris"), "is Paris"),  # both complete at " Paris": the earlier start wins
])
def test_the_earliest_stop_string_in_the_text_wins(tok, stops, first):
    ids = tok.encode(TEXT)
    shown, out, _ = _feed(tok, ids, stops)
    c = out.outputs[0]
    assert (c.text, c.stop_reason) == (TEXT[:TEXT.index(first)], first)
    assert len(c.token_ids) == _first_step_containing(tok, ids, first) + 1
    _assert_prefixes(shown, c.text)


def test_a_possible_stop_is_held_back_then_released(tok):
    ids = tok.encode(TEXT)
    paris = ids.index(tok.encode(" Paris")[0])
    shown, out, stopped = _feed(tok, ids, ("Paris!",))
    assert shown[paris] == "The capital of France is "  # "Paris" may become "Paris!"
    assert shown[paris + 1] == "The capital of France is Paris."  # it did not
    c = out.outputs[0]
    assert c.text == tok.decode(ids, skip_special_tokens=True) and c.finish_reason == "length"
    assert c.stop_reason is None and not any(stopped)
    _assert_prefixes(shown, c.text)


def test_a_stop_string_wins_over_a_stop_token_in_the_same_step(tok):
    ids = tok.encode(TEXT)
    k = _first_step_containing(tok, ids, "Paris.")
    _, out, stopped = _feed(tok, ids[:k + 1], ("Paris.",), last=("stop", ids[k]))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("The capital of France is ", "stop", "Paris.")
    assert not any(stopped)  # the core finished it already


@pytest.mark.parametrize("stops", [None, ("日本語!",), ("xyz", "🎉 do!")])
def test_multibyte_text_is_shown_once_whole_and_the_fallback_agrees(tok, stops):
    ids = tok.encode(MULTIBYTE)
    shown, out, _ = _feed(tok, ids, stops)
    final = tok.decode(ids, skip_special_tokens=True)
    assert out.outputs[0].text == final == MULTIBYTE
    assert not any("\ufffd" in s for s in shown)  # half a character is never shown
    _assert_prefixes(shown, final)
    fallback_shown, fallback_out, _ = _feed(_NoBackend(tok), ids, stops)
    assert (fallback_shown, fallback_out.outputs[0].text) == (shown, final)


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" there")
    _, out, _ = _feed(tok, ids)
    assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=True) == "Hello there"


@pytest.fixture(scope="module")
def wordlevel():
    """A fast tokenizer whose decode cleans up tokenization spaces (" ." -> ".", " 's" ->
    "'s", " ' " -> "'"): a text it showed can change when the next token arrives."""
    words = ["[UNK]", "</s>", "x", "'", "y", "it", "'s", "do", "n't", "go", ".", "hello", ",", "world", "!", "we",
             "'re", "here", "?"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True, unk_token="[UNK]",
                                   eos_token="</s>")


@pytest.mark.parametrize("stops", [None, ("don't",), ("x'y!",)])
def test_a_tokenizer_that_cleans_up_spaces_streams_prefixes_of_its_decode(wordlevel, stops):
    ids = wordlevel.encode("hello , world ! x ' y it 's do n't go . we 're here ?", add_special_tokens=False)
    final = wordlevel.decode(ids, skip_special_tokens=True)
    assert final == "hello, world! x'y it's don't go. we're here?"
    naive = [wordlevel.decode(ids[:k + 1]) for k in range(len(ids))]
    assert any(not b.startswith(a) for a, b in zip(naive, naive[1:]))  # decoding prefixes would take text back
    shown, out, _ = _feed(wordlevel, ids, stops)
    want = final[:final.index("don't")] if stops == ("don't",) else final
    assert out.outputs[0].text == want
    _assert_prefixes(shown, want)


def _long_ids(tok, n):
    ids = []
    while len(ids) < n:
        ids += tok.encode(TEXT + " " + MULTIBYTE + " ")
    return ids[:n]


def _decoded_per_step(tok, ids) -> list[int]:
    """Tokens handed to tokenizer.decode in each step of one completion (fallback path)."""
    counting = _NoBackend(tok)
    processor = OutputProcessor(counting)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=len(ids), stop=("never-there",)))
    per_step = []
    for step, token in enumerate(ids):
        before = counting.decoded
        delta = CompletionDelta(0, [token], [-1.0], None, -1.0, None)
        processor.process([EngineCoreOutput("r", [delta], False, float(step), 0.0, 0.0, 0)])
        per_step.append(counting.decoded - before)
    return per_step


def test_fallback_decodes_a_bounded_window_per_step(tok):
    """Tokens handed to tokenizer.decode per step stay the same at output token 1000 as at
    token 50 (decoding the whole output each step would hand it 1000)."""
    per_step = _decoded_per_step(tok, _long_ids(tok, 1024))
    assert max(per_step[960:]) <= max(per_step[:64]) <= 16, (max(per_step[:64]), max(per_step[960:]))


def test_a_run_of_invalid_bytes_keeps_the_window_short(tok):
    """Byte tokens that never complete a character (as a random-weight model emits them)
    would keep a window waiting for one; their text comes out as U+FFFD, as in a whole decode."""
    bad = next(i for i in range(300) if tok.decode([i] * 3) == "\ufffd" * 3)  # a lone continuation byte
    ids = tok.encode("Hi") + [bad] * 200 + tok.encode(" 日本語 there") + [bad] * 40
    want = tok.decode(ids, skip_special_tokens=True)
    for tokenizer in (tok, _NoBackend(tok)):
        shown, out, _ = _feed(tokenizer, ids)
        assert out.outputs[0].text == want
        _assert_prefixes(shown, want)
    per_step = _decoded_per_step(tok, ids)
    assert max(per_step) <= 100, max(per_step)  # waiting for a complete character would reach 200 and more


def _byte_token(tok, byte: int) -> int:
    """The id of the byte-level BPE token of one byte (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + unprintable.index(byte))
    return tok.convert_tokens_to_ids(char)


@pytest.mark.parametrize("lead", [15, 14, 31, 200])
def test_a_character_completed_after_a_run_of_invalid_bytes_loses_no_text(tok, lead):
    """A run of lone continuation bytes long enough that its text is taken as it stands,
    then a character whose 3 bytes come as 3 tokens: the decode of the run's prefix ends
    with U+FFFD where the longer decode has the character (not prefix-stable). Every piece
    streamed together must be the whole decode: nothing lost, nothing repeated."""
    bad = _byte_token(tok, 0x80)
    ids = tok.encode("Hi") + [bad] * lead + [_byte_token(tok, b) for b in "中".encode()] + tok.encode(" and more text")
    want = tok.decode(ids, skip_special_tokens=True)
    assert want.endswith("\ufffd中 and more text")  # the tokens are what this test means them to be
    for tokenizer in (tok, _NoBackend(tok)):
        shown, out, _ = _feed(tokenizer, ids)
        assert out.outputs[0].text == want
        _assert_prefixes(shown, want)
        stream = Detokenizer(tokenizer).stream()
        assert "".join([stream.push([t]) for t in ids] + [stream.flush()]) == want


def test_random_byte_token_runs_stream_exactly_their_whole_decode(tok):
    """Seeded random mixes of single-byte tokens (lone continuation bytes, lead bytes,
    characters split over tokens, invalid runs) and ordinary tokens: the pieces streamed
    together are the whole decode, on both backends."""
    rng = random.Random(0)
    byte_ids = [_byte_token(tok, b) for b in range(256)]
    words = tok.encode(" hello world 日本語 café 🎉 and")
    pools = [byte_ids, byte_ids[0x80:], byte_ids[0x80:] + words, words + byte_ids]
    for _ in range(300):
        pool = rng.choice(pools)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        want = tok.decode(ids, skip_special_tokens=True)
        for tokenizer in (tok, _NoBackend(tok)):
            stream = Detokenizer(tokenizer).stream()
            assert "".join([stream.push([t]) for t in ids] + [stream.flush()]) == want, ids


def test_decode_stream_time_per_step_does_not_grow_with_output_length(tok):
    """8 completions with stop strings: a step at output token ~1000 costs what a step at
    token ~30 costs (whole-output decoding would make it many times dearer). The two are
    timed alternately, so load on the machine slows both alike."""
    ids = _long_ids(tok, 1024)

    def processor():
        p = OutputProcessor(tok, final_outputs_only=True)  # detokenization and stop strings only
        for r in range(8):
            p.add_request(f"r{r}", None, [1], SamplingParams(max_tokens=2048, stop=("never-there", "nor this")))
        return p

    def step(p, token):
        outs = [EngineCoreOutput(f"r{r}", [CompletionDelta(0, [token], [-1.0], None, -1.0, None)], False, 0.0, 0.0,
                                 0.0, 0) for r in range(8)]
        start = time.perf_counter()
        p.process(outs)
        return time.perf_counter() - start

    long, short = processor(), processor()
    for token in ids[:960]:
        step(long, token)
    late, early = [], []
    for i in range(64):
        late.append(step(long, ids[960 + i]))
        early.append(step(short, ids[i]))
    assert statistics.median(late) < 2 * statistics.median(early) + 20e-6, (statistics.median(early),
                                                                             statistics.median(late))
