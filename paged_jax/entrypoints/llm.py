"""LLM: the notebook-facing API, with vLLM's names.

    llm = LLM("smollm2-135m", block_size=16)
    outputs = llm.generate(["Hello!"], SamplingParams(temperature=0, max_tokens=32))
    llm.beam_search(["Hello!"], BeamSearchParams(beam_width=4, max_tokens=32))
    llm.stats()

An entry point (vLLM keeps its `LLM` in vllm/entrypoints/llm.py), above the engine: it is
where `kv_allocator=` names become allocators (allocators.py), so `LLM(model,
kv_allocator="contiguous-max")` runs the paper's baselines while the engine itself knows
only the allocator interface. `from paged_jax import LLM` loads it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm.auto import tqdm

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.allocators import make_allocator
from paged_jax.loading import LoadedModel
from paged_jax.worker.compilation_cache import enable_compilation_cache


class LLM:
    def __init__(self, model: str | LoadedModel = "smollm2-135m", *, show_progress: bool = True,
                 compilation_cache: bool | str = True, **engine_settings):
        """`model`: a registered name, a .gguf file, a Hugging Face directory, a paged_jax
        checkpoint, a Hugging Face Hub id ("Qwen/Qwen3-0.6B") or an already loaded model;
        `show_progress`: a bar on stderr while the buckets compile (a cold start takes a
        minute or more on a small CPU); `compilation_cache`: keep compiled programs on disk
        and reuse them in later processes (True: ~/.cache/paged_jax/jax or
        $PAGED_JAX_CACHE_DIR; a path; False: off), as the server does: without it every
        `LLM(...)` in a new process compiles every bucket again; `engine_settings`:
        EngineConfig fields."""
        if compilation_cache:  # JAX's process-wide setting, made here because the user asked for an engine
            enable_compilation_cache(compilation_cache if isinstance(compilation_cache, str) else None)
        self.engine = LLMEngine(model, EngineConfig(**engine_settings), allocator_factory=make_allocator,
                                show_progress=show_progress)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a str, a list of str, or {"prompt_token_ids": [...]} or
        {"prompt": str} dicts, either optionally with "cache_salt"); returns one RequestOutput
        per prompt, in input order. `priority`: one int per prompt, lower served earlier
        (needs scheduling_policy="priority", as in vLLM). All prompts are validated before
        any is queued, so a bad one leaves the engine untouched."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if priority is None:
            priority = [0] * len(prompts)
        elif isinstance(priority, str) or not hasattr(priority, "__len__"):
            raise ValueError(f"priority must be a list of ints, one per prompt, got {priority!r}")
        priority = list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        return self._run(prompts, params, "generate", use_tqdm, priority)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search inside the paged engine (transformers' algorithm with
        early_stopping=False); per prompt, the beam_width beams best first. Beams share the
        KV blocks of their common prefix and fork / free blocks as beams are kept or dropped."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        outputs = self._run(list(prompts), [params] * len(prompts), "beam search", use_tqdm, [0] * len(prompts))
        return [BeamSearchOutput(o.prompt, o.prompt_token_ids,
                                 [BeamSearchSequence(c.token_ids, c.text, c.cumulative_logprob, c.score,
                                                     c.finish_reason) for c in o.outputs])
                for o in outputs]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were forgotten."""
        return self.engine.reset_prefix_cache()

    def _run(self, prompts, params, desc: str, use_tqdm: bool, priorities: list[int]) -> list[RequestOutput]:
        # validate (and tokenize, once) everything first; the engine takes the processed prompts as they are
        processed = [self.engine.processor.process(prompt) for prompt in prompts]
        # only the final outputs are returned: the engine builds no output for a running request
        # (a CUMULATIVE one would copy its whole completion every step), as vLLM's LLM asks
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) if isinstance(p, SamplingParams)
                  else p for p in params]
        ids = []
        for prompt, p, priority in zip(processed, params, priorities):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            try:
                self.engine.add_request(request_id, prompt, p, priority=priority)
            except ValueError:  # e.g. n too large for the cache: queue all or nothing
                for queued in ids:
                    self.engine.abort_request(queued)
                raise
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc=desc, disable=not use_tqdm or len(ids) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def stats(self) -> dict:
        return self.engine.stats()
