"""Structured outputs: a grammar matcher per constrained completion, a token bitmask per step.

A request's `SamplingParams.structured_outputs` (a JSON schema, any JSON object, a regex, a
choice list or an EBNF grammar) is compiled by llguidance, the grammar library vLLM and
llama.cpp use, for the model's tokenizer. Each completion under a constraint gets its
own matcher; before each step, every row that samples under one gets the matcher's bitmask
of allowed next tokens (i32, bit t % 32 of word t // 32), which the runner's masked head
applies before sampling; after the step, the matcher consumes the sampled token. Rows
without a constraint keep an all-ones row, and a step without any constrained row uses
the unmasked head.

Why this works with the paged engine's tricks: a matcher follows a completion's *output*
tokens, which preemption never changes (recompute re-prefills them without sampling,
swap restores them), so it just waits; the n completions of a request are forked before
their first token, so each starts a fresh matcher; prefix caching touches only the prompt.
When the grammar is complete and admits nothing more, the completion stops ("stop"), as
in vLLM; a stop token (EOS where the grammar allows it) ends the completion without
reaching the matcher, as vLLM's EOS does. A matcher that fails (it refused a token that
its own mask should have kept out, or llguidance reported an internal error) ends its
completion with finish reason "error", logged with llguidance's message, as vLLM v1's
scheduler ends it with FINISHED_ERROR: a failure must never read as a normal stop (the
server answers it with a 500).

Host-side and jax-free: `GrammarCompiler` wraps the library (built once per engine from
its tokenizer, cached grammars), `StructuredOutputManager` is the engine core's per-step
bookkeeping. A schema or grammar the library refuses is a ValueError with its message
(the server's 400) when the request is added.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

from paged_jax.core.sequence import Sequence, SequenceStatus
from paged_jax.core.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """llguidance for one tokenizer: constraints -> grammars (cached) -> matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = [int(t) for t in eos_token_ids]

    @functools.cached_property
    def _ll_tokenizer(self):
        """The tokenizer in llguidance's form (~1 s to build: once, at the first constrained request)."""
        import llguidance.hf
        return llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)

    @functools.lru_cache(maxsize=256)
    def grammar(self, kind: str, text: str, flexible_whitespace: bool = True) -> str:
        """The validated grammar of a constraint (`StructuredOutputsParams.spec()`); ValueError
        with llguidance's message when the schema, regex or grammar is invalid."""
        import llguidance
        try:
            if kind in ("json", "json_object"):  # vLLM's JSON defaults for llguidance
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": flexible_whitespace})
            else:
                grammar = llguidance.grammar_from(kind, text)
        except (ValueError, TypeError) as exc:  # e.g. a JSON schema that is not JSON
            raise ValueError(f"invalid structured_outputs.{kind}: {exc}") from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:
            raise ValueError(f"invalid structured_outputs.{kind}: {messages[0]}")
        return grammar

    def matcher(self, params: StructuredOutputsParams):
        import llguidance
        matcher = llguidance.LLMatcher(self._ll_tokenizer, self.grammar(*params.spec()), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured_outputs.{params.kind}: {matcher.get_error()}")
        return matcher


class StructuredOutputManager:
    """The engine core's side: matchers by sequence, the step's bitmask, tokens consumed."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.mask_words = -(-compiler.vocab_size // 32)
        self._matchers: dict[int, object] = {}  # seq id -> LLMatcher

    @property
    def num_matchers(self) -> int:
        """Matchers alive (one per constrained sequence not yet dropped): the pool check's leak count."""
        return len(self._matchers)

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (and cache) the request's grammar now: an invalid one is refused before it is queued."""
        self.compiler.grammar(*params.spec())

    def _matcher(self, seq: Sequence):
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = self._matchers[seq.seq_id] = self.compiler.matcher(seq.sampling_params.structured_outputs)
            if seq.output_token_ids and not matcher.consume_tokens(seq.output_token_ids):  # a fork of a running one
                raise AssertionError(f"sequence {seq.seq_id}'s tokens do not match its grammar")
        return matcher

    @staticmethod
    def _constrained(chunks, seqs) -> list[tuple[int, Sequence]]:
        return [(row, seqs[c.seq_id]) for row, c in enumerate(chunks)
                if c.sample and seqs[c.seq_id].sampling_params.structured_outputs is not None]

    def has_constrained_rows(self, chunks, seqs) -> bool:
        """Whether a row that samples this step is under a constraint (the step needs a mask)."""
        return any(c.sample and seqs[c.seq_id].sampling_params.structured_outputs is not None for c in chunks)

    def bitmask(self, chunks, seqs) -> np.ndarray | None:
        """i32[len(chunks), mask_words] for a step whose sampling rows include a constrained
        one (all ones elsewhere), else None."""
        rows = self._constrained(chunks, seqs)
        if not rows:
            return None
        mask = np.full((len(chunks), self.mask_words), -1, np.int32)
        matchers = [(self._matcher(seq), row) for row, seq in rows]
        # llguidance's executor fills the rows on its own threads, the GIL released (vLLM's way)
        self._executor.unsafe_compute_mask_ptr(matchers, mask.ctypes.data, mask.shape[1] * 4, len(chunks))
        return mask

    @functools.cached_property
    def _executor(self):
        import llguidance
        return llguidance.LLExecutor(num_threads=max(1, os.cpu_count() or 1))

    def accept(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """Advance `seq`'s matcher by its sampled token. FINISHED_STOPPED: the grammar is
        complete (nothing more may follow); FINISHED_ERROR: the matcher failed (logged here
        with llguidance's message); None: the completion goes on (or has no constraint)."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            return None
        if not matcher.consume_token(token) or matcher.is_error():
            logger.error("the grammar matcher of request %s (completion %d) failed at token %d: %s; the "
                         "completion ends with finish reason 'error'", seq.request_id, seq.index, token,
                         matcher.get_error() or "the token was refused")
            return SequenceStatus.FINISHED_ERROR
        return SequenceStatus.FINISHED_STOPPED if matcher.is_stopped() else None

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
