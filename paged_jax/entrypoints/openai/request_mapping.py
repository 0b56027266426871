"""OpenAI request bodies -> engine prompts and SamplingParams, refusing what cannot be honoured.

Everything here raises APIError(400) with a message naming the argument, before the
request reaches the engine. Sampling values themselves are checked by SamplingParams
(its ValueError becomes the 400's message), prompt token ids (empty, too long, outside
the vocabulary) by LLMEngine.add_request (its ValueError arrives through the engine loop
and is mapped the same way).

Prompts reach the engine as token ids only: text is tokenized here (`prompt_token_ids`,
`chat_prompt_ids`), called by the app on its tokenizer thread, so that the engine thread
never spends a step's time encoding a long prompt.
"""

from __future__ import annotations

import dataclasses

from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.outputs import CompletionOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.core.structured_outputs import KINDS, StructuredOutputsParams
from paged_jax.engine.processor import validate_max_tokens
from paged_jax.entrypoints.openai.errors import bad_request
from paged_jax.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

MAX_N = 128  # OpenAI's own limit on n
# the engine samples in float32: a larger temperature is inf there, and logits / inf are 0
# (or NaN where a structured-output mask put -inf), so top-k, min-p and the mask stopped working
MAX_TEMPERATURE = 3.4028234663852886e38  # np.finfo(np.float32).max


def max_logprobs(engine) -> int:
    """How many top alternatives per token the server can return: the engine's
    `max_logprobs` where its outputs carry `top_logprobs`, else 1 (the sampled token's
    logprob is all an engine without them returns)."""
    has_top = "top_logprobs" in {f.name for f in dataclasses.fields(CompletionOutput)}
    return int(getattr(engine.config, "max_logprobs", 1)) if has_top else 1


def _logprobs_message(name: str, value: int, limit: int) -> str:
    if limit == 1:
        return (f"{name}={value} asks for top alternatives, but only the sampled token's logprob is available: "
                f"{name} must be 0 or 1 (or null)")
    return f"{name}={value} is more than this server returns: {name} must be in [0, {limit}] (or null)"


def check_common(req: CompletionRequest | ChatCompletionRequest, logprobs_limit: int,
                 scheduling_policy: str = "fcfs") -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad_request(f"{name} is not supported by this server (only 0 or null)", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.use_beam_search:
        check_beam_search(req)
    elif req.length_penalty not in (None, 1):
        raise bad_request("length_penalty only applies to beam search (use_beam_search: true)", "length_penalty")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be an int in [1, {MAX_N}], got {req.n}", "n")
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise bad_request(f"temperature must be at most {MAX_TEMPERATURE:.8g} (the largest float32: the engine "
                          f"samples in float32), got {req.temperature:g}", "temperature")
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string (or null)", "cache_salt")
    if req.priority != 0 and scheduling_policy != "priority":  # vLLM's rule and message
        raise bad_request(f"priority={req.priority} requires the server's --scheduling_policy priority "
                          f"(it runs {scheduling_policy!r})", "priority")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= logprobs_limit:
        raise bad_request(_logprobs_message("prompt_logprobs", req.prompt_logprobs, logprobs_limit), "prompt_logprobs")


def check_beam_search(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse what a beam search cannot honour, instead of dropping it as vLLM does: its
    beams end at EOS or max_tokens only, return no logprobs, and rank the model's own
    log-probabilities (so no sampling filter or output constraint applies)."""
    conflicts = {"stop": bool(req.stop), "stop_token_ids": bool(req.stop_token_ids),
                 "logprobs": req.logprobs not in (None, False), "top_logprobs": getattr(req, "top_logprobs", None) is not None,
                 "prompt_logprobs": req.prompt_logprobs is not None, "top_p": req.top_p not in (None, 1),
                 "top_k": req.top_k not in (None, 0, -1), "min_p": req.min_p not in (None, 0),
                 "response_format": req.response_format is not None and req.response_format.get("type") != "text",
                 "structured_outputs": req.structured_outputs is not None}
    for name, conflict in conflicts.items():
        if conflict:
            raise bad_request(f"{name} is not supported with use_beam_search (beams end at EOS or max_tokens, "
                              "return no logprobs and rank the model's own log-probabilities)", name)


def beam_search_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                       default_max_tokens: int) -> BeamSearchParams:
    """BeamSearchParams from a request with use_beam_search (checked by check_beam_search):
    vLLM's mapping, n beams; its ValueError becomes a 400 naming the field."""
    try:
        return BeamSearchParams(beam_width=req.n,
                                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                ignore_eos=req.ignore_eos)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        field = {"beam_width": "n"}.get(message.split(" ", 1)[0], message.split(" ", 1)[0])
        raise bad_request(message, field if field in type(req).model_fields else None) from exc


def check_completion(req: CompletionRequest, logprobs_limit: int, scheduling_policy: str = "fcfs") -> None:
    check_common(req, logprobs_limit, scheduling_policy)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 only with echo: true, which returns the prompt alone)",
                          "max_tokens")
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of is not supported (only best_of == n); got best_of={req.best_of}, n={req.n}",
                          "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= logprobs_limit:
        raise bad_request(_logprobs_message("logprobs", req.logprobs, logprobs_limit), "logprobs")


def check_chat(req: ChatCompletionRequest, logprobs_limit: int, scheduling_policy: str = "fcfs") -> None:
    check_common(req, logprobs_limit, scheduling_policy)
    if req.tools or req.tool_choice not in (None, "none"):
        raise bad_request("tools and tool_choice are not supported by this server", "tools")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= logprobs_limit:
            raise bad_request(_logprobs_message("top_logprobs", req.top_logprobs, logprobs_limit), "top_logprobs")


def completion_echo(req: CompletionRequest) -> tuple[int | None, int | None]:
    """(max_tokens, prompt_logprobs) for the engine, as vLLM maps echo: `max_tokens: 0`
    runs one token that the response leaves out (the engine generates at least one), and
    echo with `logprobs: k` asks for the prompt's logprobs with k alternatives."""
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    return (1 if req.echo and req.max_tokens == 0 else req.max_tokens), prompt_logprobs


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """One entry per OpenAI prompt: its text, or its token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be an empty list", "prompt")
    if isinstance(p[0], str):
        return list(p)
    if isinstance(p[0], int):
        return [list(p)]
    return [list(ids) for ids in p]


def prompt_token_ids(prompts: list[str | list[int]], tokenizer) -> list[list[int]]:
    """Text prompts tokenized as LLMEngine.add_request would (`tokenizer.encode`), id lists
    as they are. Blocking (tens of ms for a long prompt): the app runs it off the event loop."""
    return [_encode(p, tokenizer) if isinstance(p, str) else p for p in prompts]


def _encode(text: str, tokenizer) -> list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: give the prompt as token ids", "prompt")
    try:  # json_body.py refuses lone surrogates already; a caller without it still gets a 400
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"the prompt is not valid Unicode text: {exc.reason} at index {exc.start}", "prompt") from exc
    return [int(t) for t in tokenizer.encode(text)]


def engine_prompt(token_ids: list[int], cache_salt: str | None) -> dict:
    """The dict prompt LLMEngine.add_request takes; the salt only when the request has one."""
    prompt = {"prompt_token_ids": list(token_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template expects them: role and plain-text content."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.type if hasattr(part, "type") else part.get("type")
                if kind != "text":
                    raise bad_request(f"messages[{i}].content: only text content parts are supported, got {kind!r}",
                                      "messages")
                # a part that failed TextContentPart arrives as a dict: its text is checked, never str()-ed
                text = part.text if hasattr(part, "text") else part.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"messages[{i}].content[{j}].text must be a string, got "
                                      f"{'nothing' if text is None else type(text).__name__}", "messages")
                texts.append(text)
            content = "\n".join(texts)
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return messages


def chat_echo_text(messages: list[dict]) -> str:
    """What chat `echo` puts before the reply (vLLM's rule): the last message's content when
    that message is the assistant's (the reply continues it), else nothing."""
    return messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""


def chat_prompt_ids(messages: list[dict], tokenizer) -> list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is unavailable; use /v1/completions with "
                          "token ids", "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as exc:  # jinja TemplateError (e.g. a role the template refuses), no template
        raise bad_request(f"the chat template cannot render these messages: {exc}", "messages") from exc
    return [int(t) for t in ids]


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's output constraint: OpenAI's `response_format` or vLLM's
    `structured_outputs` (not both); a malformed one is a 400 naming the field. Whether the
    schema or grammar itself is valid is llguidance's to say (`check_structured_outputs`)."""
    if req.response_format is not None and req.structured_outputs is not None:
        raise bad_request("give response_format or structured_outputs, not both", "response_format")
    if req.structured_outputs is not None:
        fields = {k: v for k, v in req.structured_outputs.items() if v is not None}
        unknown = set(fields) - set(KINDS) - {"disable_any_whitespace"}
        if unknown:
            raise bad_request(f"structured_outputs: unknown or unsupported fields {sorted(unknown)}; this server "
                              f"takes one of {', '.join(KINDS)} (and disable_any_whitespace)", "structured_outputs")
        try:
            return StructuredOutputsParams(**fields)
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), "structured_outputs") from exc
    fmt = req.response_format
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              "response_format")
        return StructuredOutputsParams(json=schema)  # strict or not, the schema is enforced (as vLLM)
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                      f"{fmt.get('type')!r}", "response_format")


def check_structured_outputs(req: CompletionRequest | ChatCompletionRequest, params: SamplingParams, engine) -> None:
    """Compile the constraint's grammar for the engine's tokenizer (a 400 with llguidance's
    message when invalid; cached for the engine thread); blocking, so the app runs it on
    its tokenizer thread."""
    if getattr(params, "structured_outputs", None) is None:  # none asked for, or a beam search
        return
    param = "structured_outputs" if req.structured_outputs is not None else "response_format"
    manager = getattr(getattr(engine, "core", None), "structured_outputs", None)
    if manager is None:
        raise bad_request("structured outputs need a model with a tokenizer (and llguidance installed)", param)
    try:
        manager.check(params.structured_outputs)
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc


def request_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                   default_max_tokens: int, logprobs: int | None,
                   prompt_logprobs: int | None = None) -> SamplingParams | BeamSearchParams:
    """The engine's params for the request: BeamSearchParams with use_beam_search, else
    SamplingParams."""
    if req.use_beam_search:
        return beam_search_params(req, max_tokens=max_tokens, default_max_tokens=default_max_tokens)
    return sampling_params(req, max_tokens=max_tokens, default_max_tokens=default_max_tokens, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs)


def prompt_params(params: SamplingParams | BeamSearchParams, *, max_tokens: int | None, num_prompt_tokens: int,
                  max_model_len: int, param: str) -> SamplingParams | BeamSearchParams:
    """The params of one tokenized prompt. A request that gave `max_tokens` must fit it
    with the prompt into max_model_len: else a 400 naming `param` (vLLM's answer), never a
    completion cut short unasked. One that did not gets the context its prompt leaves, as
    in vLLM. (A prompt too long by itself is left to the engine's prompt check.)"""
    if max_tokens is None:
        return dataclasses.replace(params, max_tokens=max(1, max_model_len - num_prompt_tokens))
    if num_prompt_tokens < max_model_len:
        try:
            validate_max_tokens(num_prompt_tokens, max_tokens, max_model_len)
        except ValueError as exc:
            raise bad_request(str(exc), param) from exc
    return params


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None, default_max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the request; its ValueError becomes a 400 naming the field.
    `max_tokens` None means `default_max_tokens` (prompt_params then gives each prompt the
    context it leaves)."""
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    top_k = req.top_k
    if top_k == -1:  # vLLM spells "off" as -1, the engine as 0
        top_k = 0
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k or 0,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(req.stop_token_ids) if req.stop_token_ids else None,
            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs(req),
            # a stream sends what is new each step, a whole answer waits for the end (vLLM's choice)
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        raise bad_request(message, field if field in type(req).model_fields else None) from exc
