"""Request bodies of the OpenAI API subset the server speaks, as pydantic models (responses:
protocol_responses.py, re-exported here).

Requests are validated strictly (a string where a number belongs is a 400, never a
silent coercion; a whole number written 2.0 is the integer 2, as JSON means it:
json_body.py). Unknown fields are ignored so that clients which send extra
OpenAI arguments keep working, but the known arguments this engine cannot honour
(`suffix`, `best_of`, penalties, `logit_bias`, tools) are
declared here and refused with a 400 when set to anything but their neutral value
(`request_mapping.py`), so nothing a client asks for is quietly dropped.

vLLM's extensions `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `return_token_ids`,
`prompt_logprobs`, `priority`, chat `echo`, `cache_salt` and beam search (`use_beam_search`
with `n` beams, `length_penalty`) are accepted too. Completions'
`echo` puts the prompt before the completion (its tokens' logprobs too, when `logprobs` is
set), and `max_tokens: 0` with it scores the prompt without generating: what
lm-evaluation-harness's loglikelihood requests send. `response_format` (JSON mode, a JSON
schema) and vLLM's `structured_outputs` constrain the output
(request_mapping.structured_outputs). `cache_salt` isolates a tenant's prefix cache:
requests with different salts (or one with and one without) never share cached KV blocks,
so a request cannot learn from its time to first token whether another tenant sent the
same prefix. It must be a non-empty string or null (an empty salt is a 400, as in vLLM).

The OpenAPI schema (GET /openapi.json) is generated from these models, and says what the
server accepts: types, ranges, enums, which arguments need which (`_if_then`), and that an
unsupported argument takes only its neutral value. pydantic checks the types only; the
ranges are checked by request_mapping.py and SamplingParams, whose 400s name the argument
in their own words (tests/entrypoints/test_server_errors.py), so a bound is put in the
schema with `WithJsonSchema` (documented, not enforced twice). Bounds that depend on the
server (the served model's name, the vocabulary, how many logprobs, whether `priority`
is honoured) are marked with LIMIT and filled in per app by openapi_docs.py. The schema
is exact in one direction: whatever violates it is refused (schema fuzzing checks this,
experiments/benchmarks/schema_fuzz.py); a body it allows can still be refused for what a
schema cannot say (a prompt longer than max_model_len, `best_of` equal to `n`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from paged_jax.entrypoints.openai.protocol_responses import (  # noqa: F401 (re-exported)
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta, ChatLogprobs,
    ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse, ErrorInfo, ErrorResponse, HealthStatus,
    ModelCard, ModelList, PromptLogprob, TopLogprob, UsageInfo)

LIMIT = "x-server-limit"  # a bound openapi_docs.apply_server_limits fills in: one of SERVER_LIMITS
SERVER_LIMITS = ("served_model", "token_id", "logprobs", "priority")


def _doc(**schema) -> WithJsonSchema:
    """The JSON schema of a value, for the OpenAPI document only (see the module docstring)."""
    return WithJsonSchema(schema)


TOKEN_ID = {"type": "integer", "minimum": 0, LIMIT: "token_id"}  # maximum: the vocabulary's last id
Model = Annotated[str, _doc(type="string", **{LIMIT: "served_model"})]
Logprobs = Annotated[int, _doc(type="integer", minimum=0, **{LIMIT: "logprobs"})]
StopStrings = Annotated[str | list[str], _doc(anyOf=[
    {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}}])]
Prompt = Annotated[str | list[str] | list[int] | list[list[int]], _doc(anyOf=[
    {"type": "string", "minLength": 1, "description": "a text"},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}, "description": "a batch of texts"},
    {"type": "array", "minItems": 1, "items": TOKEN_ID, "description": "token ids"},
    {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": TOKEN_ID},
     "description": "a batch of token-id lists"}])]
JSON_SCHEMA = {"type": "object", "description": "a JSON schema"}
ResponseFormat = Annotated[dict[str, Any], _doc(oneOf=[
    {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"], "title": "text"},
    {"type": "object", "properties": {"type": {"const": "json_object"}}, "required": ["type"], "title": "JSON mode"},
    {"type": "object", "title": "a JSON schema", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "schema": JSON_SCHEMA, "name": {"description": "accepted and unused"},
            "description": {"description": "accepted and unused"},
            "strict": {"description": "accepted and unused: the schema is enforced either way (as vLLM)"}}}}}])]
_KIND_SET = {"json": {"not": {"type": "null"}}, "regex": {"not": {"type": "null"}},
             "choice": {"not": {"type": "null"}}, "grammar": {"not": {"type": "null"}}, "json_object": {"const": True}}
StructuredOutputs = Annotated[dict[str, Any], _doc(
    type="object", description="exactly one constraint: json, json_object, regex, choice or grammar",
    properties={"json": {"type": ["object", "string", "null"], "description": "a JSON schema, or its JSON text"},
                "json_object": {"type": ["boolean", "null"], "description": "any JSON object"},
                "regex": {"type": ["string", "null"], "minLength": 1},
                "choice": {"type": ["array", "null"], "minItems": 1, "items": {"type": "string"}},
                "grammar": {"type": ["string", "null"], "minLength": 1, "description": "a Lark grammar"},
                "disable_any_whitespace": {"type": ["boolean", "null"],
                                           "description": "JSON without free whitespace (vLLM's flag)"}},
    additionalProperties={"type": "null"},
    oneOf=[{"required": [kind], "properties": {kind: schema}} for kind, schema in _KIND_SET.items()])]


def _if_then(field: str, value: dict, then_field: str, then_value: dict) -> dict:
    """JSON Schema for "when `field` is given as `value`, `then_field` must be `then_value`"."""
    return {"if": {"required": [field], "properties": {field: value}},
            "then": {"required": [then_field], "properties": {then_field: then_value}}}


_OBJECT, _TRUE = {"type": "object"}, {"const": True}
_COMMON_RULES = [_if_then("stream_options", _OBJECT, "stream", _TRUE),
                 {"not": {"required": ["response_format", "structured_outputs"],
                          "properties": {"response_format": _OBJECT, "structured_outputs": _OBJECT}},
                  "description": "response_format or structured_outputs, not both"}]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="one last chunk with `usage` and no choices")


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Model = Field(description="the served model's name (GET /v1/models); any other is a 404")
    n: Annotated[int, _doc(type="integer", minimum=1, maximum=128)] = Field(
        1, description="completions per prompt; prompts x n at most the server's queue bound")
    temperature: Annotated[float, _doc(type="number", minimum=0, maximum=3.4028234663852886e38)] | None = Field(
        None, description="0: greedy; null: 1.0, as OpenAI; at most the largest float32 (the engine samples in it)")
    top_p: Annotated[float, _doc(type="number", exclusiveMinimum=0, maximum=1)] | None = Field(
        None, description="nucleus mass; null: 1 (off)")
    top_k: Annotated[int, _doc(type="integer", minimum=-1, maximum=2**31 - 1)] | None = Field(
        None, description="vLLM extension: the k most likely tokens; 0 or -1: off")
    min_p: Annotated[float, _doc(type="number", minimum=0, maximum=1)] | None = Field(
        None, description="vLLM extension: drop tokens below min_p x p(most likely); 0: off")
    seed: Annotated[int, _doc(type="integer", minimum=0, maximum=2**32 - 1)] | None = Field(
        None, description="the sample stream depends only on (seed, token index)")
    stop: StopStrings | None = Field(None, description="stop strings, not included in the text")
    stop_token_ids: Annotated[list[int], _doc(type="array", items={"type": "integer", "minimum": 0})] | None = Field(
        None, description="vLLM extension: stop tokens besides EOS")
    ignore_eos: bool = Field(False, description="vLLM extension: generate exactly max_tokens (benchmarks)")
    return_token_ids: bool = Field(False, description="vLLM extension: choices (and chunks) carry the generated "
                                                      "token ids")
    cache_salt: Annotated[str, _doc(type="string", minLength=1)] | None = Field(
        None, description="vLLM extension: prefix-cache blocks are shared only between requests with the same salt")
    prompt_logprobs: Logprobs | None = Field(
        None, description="vLLM extension: each prompt token's logprob and the top k there (`prompt_logprobs`)")
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM extension, disaggregated prefill / decode (servers with --kv_connector): "
                          "{\"do_remote_decode\": true} on a prefill server, whose response's kv_transfer_params "
                          "a decode server then takes to pull the prompt's K/V")
    priority: Annotated[int, _doc(type="integer", **{LIMIT: "priority"})] = Field(
        0, description="vLLM extension: lower runs earlier, with the server's --scheduling_policy priority "
                       "(else only 0)")
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's constrained output: text (none), JSON mode, or a JSON schema")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's constrained output (instead of response_format)")
    stream: bool = Field(False, description="server-sent events, ending with `data: [DONE]`")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = Field(None, description="accepted and unused")
    presence_penalty: Annotated[float, _doc(type="number", enum=[0])] | None = Field(
        None, description="not supported: 0 or null only")
    frequency_penalty: Annotated[float, _doc(type="number", enum=[0])] | None = Field(
        None, description="not supported: 0 or null only")
    logit_bias: Annotated[dict[str, float], _doc(type="object", maxProperties=0)] | None = Field(
        None, description="not supported: empty or null only")
    use_beam_search: bool | None = Field(
        None, description="vLLM extension: beam search with n beams, the n best returned best first; ranks the "
                          "model's own log-probabilities, so temperature and seed change nothing (as in vLLM); "
                          "not with stop, stop_token_ids, logprobs, prompt_logprobs, top_p, top_k, min_p or a "
                          "structured output")
    length_penalty: float | None = Field(
        None, description="vLLM extension, beam search only: a finished beam scores cum_logprob / "
                          "len ** length_penalty (default 1)")


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": _COMMON_RULES + [
        _if_then("max_tokens", {"const": 0}, "echo", _TRUE)]})
    prompt: Prompt = Field(description="a text, a batch of texts, token ids, or a batch of token-id lists "
                                       "(each at most max_model_len tokens with its completion)")
    max_tokens: Annotated[int, _doc(type="integer", minimum=0)] | None = Field(
        16, description="new tokens at most (OpenAI's default 16); 0 only with echo: the prompt scored alone; "
                        "null: up to max_model_len")
    logprobs: Logprobs | None = Field(None, description="the top alternatives per token (0: the sampled token's "
                                                        "logprob only)")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: its tokens' too)")
    suffix: Annotated[str | None, _doc(type="null")] = Field(None, description="not supported: null only")
    best_of: Annotated[int | None, _doc(type="null")] = Field(None, description="not supported: null (or equal to "
                                                                                "n) only")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is rendered as system")
    # non-text parts validate (so that their 400 says "only text content parts") but are not documented
    content: str | list[TextContentPart] | SkipJsonSchema[list[dict[str, Any]]] | None = Field(
        None, description="text, or text parts (joined with newlines)")
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": _COMMON_RULES + [
        _if_then("top_logprobs", {"type": "integer"}, "logprobs", _TRUE)]})
    messages: list[ChatMessage] = Field(min_length=1, description="rendered with the model's chat template")
    max_tokens: Annotated[int, _doc(type="integer", minimum=1)] | None = Field(
        None, description="deprecated by OpenAI in favour of max_completion_tokens")
    max_completion_tokens: Annotated[int, _doc(type="integer", minimum=1)] | None = Field(
        None, description="new tokens at most; null: up to max_model_len")
    logprobs: bool = Field(False, description="each generated token's logprob")
    top_logprobs: Logprobs | None = Field(None, description="the top alternatives per token; needs logprobs: true")
    echo: bool = Field(False, description="vLLM extension: a last assistant message's content starts the reply's "
                                          "content")
    tools: Annotated[list[Any], _doc(type="array", maxItems=0)] | None = Field(
        None, description="not supported: empty or null only")
    tool_choice: Annotated[Any, _doc(enum=["none", None])] = Field(None, description="not supported: \"none\" or "
                                                                                     "null only")
