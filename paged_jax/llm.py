"""LLM: the notebook-facing API, with vLLM's names.

    llm = LLM("smollm2-135m", block_size=16)
    outputs = llm.generate(["Hello!"], SamplingParams(temperature=0, max_tokens=32))
    llm.stats()
"""

from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from paged_jax.loading import LoadedModel
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | LoadedModel = "smollm2-135m", **engine_settings):
        """`model`: a registered name, a .gguf file, a Hugging Face directory, a paged_jax
        checkpoint or an already loaded model; `engine_settings`: EngineConfig fields."""
        self.engine = LLMEngine(model, EngineConfig(**engine_settings))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a str, a list of str, or {"prompt_token_ids": [...]}
        dicts); returns one RequestOutput per prompt, in input order. All prompts are
        validated before any is queued, so a bad one leaves the engine untouched."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for prompt in prompts:  # validate everything first
            _, ids = self.engine._tokenize(prompt)
            self.engine._validate_prompt(ids)
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def stats(self) -> dict:
        return self.engine.stats()
