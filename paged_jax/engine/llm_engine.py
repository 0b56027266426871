"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

For servers and research loops: `add_request`, `step`, `abort_request`,
`has_unfinished_requests`, `stats`, `reset_prefix_cache`. It is the engine core
(engine_core.py: KV cache, scheduler, block manager, runner, statistics; token ids only) with a
front end around it, as in vLLM's v1 engine: the processor turns prompts into validated
token ids (processor.py), and the output processor turns the core's new tokens into
text, stop strings and RequestOutputs (output_processor.py). A stop string found in the
text ends its sequence in the core before the next step, so its blocks are freed at once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import time

import jax
import jax.numpy as jnp

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.outputs import RequestOutput
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.core_requests import completion_seed
from paged_jax.engine.engine_core import EngineCore, paged_allocator
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.processor import ProcessedPrompt, Processor
from paged_jax.engine.grammar_matchers import GrammarCompiler, StructuredOutputManager
from paged_jax.loading import LoadedModel, load_model
from paged_jax.loading.transformers_import import import_transformers
from paged_jax.worker.model_runner import ModelRunner

__all__ = ["LLMEngine", "completion_seed"]


def _with_dtype(loaded: LoadedModel, dtype: str) -> LoadedModel:
    """A model given as a LoadedModel in another dtype than the engine's runs in the
    engine's (EngineConfig.dtype names the weights' dtype)."""
    if loaded.params is None or all(jnp.dtype(a.dtype) == jnp.dtype(dtype) for a in jax.tree.leaves(loaded.params)):
        return loaded
    return dataclasses.replace(loaded, params=jax.tree.map(lambda a: a.astype(dtype), loaded.params))


def _structured_outputs(loaded: LoadedModel, runner_factory) -> StructuredOutputManager | None:
    """The grammar matchers for constrained requests, where they can work: a fast Hugging
    Face tokenizer (llguidance reads its vocabulary), llguidance installed, and a runner
    that samples under a mask (ModelRunner; the simulator's model-free runners do not)."""
    fast_tokenizer = import_transformers().PreTrainedTokenizerFast
    if not isinstance(loaded.tokenizer, fast_tokenizer) or importlib.util.find_spec("llguidance") is None:
        return None
    if "structured_outputs" not in inspect.signature(runner_factory).parameters:
        return None
    return StructuredOutputManager(GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size,
                                                   loaded.config.eos_token_ids))


class LLMEngine:
    def __init__(self, model: str | LoadedModel = "smollm2-135m", config: EngineConfig | None = None, *,
                 runner_factory=ModelRunner, clock=time.monotonic, final_outputs_only: bool = False,
                 allocator_factory=paged_allocator, show_progress: bool = False):
        """`runner_factory` (ModelRunner's signature) and `clock` (seconds) are injection
        points: experiments/simulate.py passes a model-free runner and a virtual clock, so
        a simulation runs this engine's own scheduling and bookkeeping, not a copy.
        `final_outputs_only`: `step` returns finished requests only, whatever a request's
        SamplingParams.output_kind asks (otherwise CUMULATIVE requests get an output per
        step with their whole completion so far, DELTA ones what is new, FINAL_ONLY ones
        one at the end). `allocator_factory`: the
        KV allocator (EngineCore's; the paper's baselines:
        paged_jax.entrypoints.allocators.make_allocator, which paged_jax.LLM passes).
        `show_progress`: a progress bar on stderr while warm-up compiles the buckets."""
        config = config or EngineConfig()
        mesh = None
        if config.tensor_parallel_size > 1:  # shard over a device mesh (paged_jax/distributed/tensor_parallel.py)
            from paged_jax.distributed import tensor_parallel
            mesh = tensor_parallel.make_mesh(config.tensor_parallel_size)
            loaded = tensor_parallel.load_sharded(model, config.dtype, mesh)
        else:
            loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=config.dtype)
            loaded = _with_dtype(loaded, config.dtype)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        if loaded.model_class is not None:  # a researcher's own Flax decoder (LoadedModel.model_class)
            runner_factory = functools.partial(runner_factory, model_class=loaded.model_class)
        self.core = EngineCore(loaded.config, loaded.params, config, runner_factory=runner_factory, clock=clock,
                               mesh=mesh, structured_outputs=_structured_outputs(loaded, runner_factory),
                               allocator_factory=allocator_factory, show_progress=show_progress)
        self.processor = Processor(self.tokenizer, self.core.config.max_model_len, self.model_config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, final_outputs_only=final_outputs_only)

    # the core's parts, for tests, experiments and the server's metrics
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def stats_tracker(self):
        return self.core.stats_tracker

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int] | ProcessedPrompt,
                    params: SamplingParams | BeamSearchParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. `prompt` is text, a list of token ids, {"prompt_token_ids": [...]}
        or {"prompt": text} (either dict may add "cache_salt": str); `params` a
        SamplingParams or, for beam search, a BeamSearchParams; `priority` an int, lower
        served earlier (needs scheduling_policy="priority" unless 0, as in vLLM). Raises
        ValueError (and queues nothing) on bad input. A ProcessedPrompt (this engine's
        `processor` made it: LLM validates a batch before queuing any) is not tokenized again."""
        params = params or SamplingParams()
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.processor.process(prompt)
        self.core.add_request(request_id, processed, params, arrival_time=arrival_time,
                              cache_salt=processed.cache_salt, priority=priority)
        self.output_processor.add_request(request_id, processed.text, processed.token_ids, params)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks at once (unknown or finished ids: no-op)."""
        self.core.abort_request(request_id)
        self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (e.g. between benchmark runs); returns how many."""
        return self.core.reset_prefix_cache()

    def export_prompt_kv(self, prompt_token_ids, *, cache_salt: str | None = None):
        """Disaggregated prefill: the K/V of the prompt's cached blocks as a PromptKV, or None
        (engine/kv_transfer.py; needs EngineConfig(kv_transfer=True))."""
        return self.core.export_prompt_kv(prompt_token_ids, cache_salt=cache_salt)

    def import_prompt_kv(self, kv) -> int:
        """Disaggregated decode: adopt a PromptKV into this engine's prefix cache before adding
        its request; returns the blocks written."""
        return self.core.import_prompt_kv(kv)

    def stats(self) -> dict:
        return self.core.stats()

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one jitted step, and return the requests that moved or finished."""
        core_outputs = self.core.step()
        if not core_outputs:
            return []
        start = time.perf_counter()
        processed = self.output_processor.process(core_outputs)
        for request_id, index, stop in processed.stopped:
            self.core.finish_sequence(request_id, index, stop)
        # the step's host time includes turning its tokens into outputs
        self.core.stats_tracker.add_host_seconds(time.perf_counter() - start)
        return processed.request_outputs
