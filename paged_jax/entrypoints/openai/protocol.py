"""Request and response bodies of the OpenAI API subset the server speaks, as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, never a
silent coercion). Unknown fields are ignored so that clients which send extra
OpenAI arguments keep working, but the known arguments this engine cannot honour
(`suffix`, `best_of`, penalties, `logit_bias`, tools) are
declared here and refused with a 400 when set to anything but their neutral value
(`request_mapping.py`), so nothing a client asks for is quietly dropped.

vLLM's extensions `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `return_token_ids`,
`prompt_logprobs`, `priority`, chat `echo` and `cache_salt` are accepted too. Completions'
`echo` puts the prompt before the completion (its tokens' logprobs too, when `logprobs` is
set), and `max_tokens: 0` with it scores the prompt without generating: what
lm-evaluation-harness's loglikelihood requests send. `response_format` (JSON mode, a JSON
schema) and vLLM's `structured_outputs` constrain the output
(request_mapping.structured_outputs). `cache_salt` isolates a tenant's prefix cache:
requests with different salts (or one with and one without) never share cached KV blocks,
so a request cannot learn from its time to first token whether another tenant sent the
same prefix. It must be a non-empty string or null (an empty salt is a 400, as in vLLM).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False  # one last chunk with `usage` and no choices


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; 0 or -1 = off
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens (benchmarks)
    return_token_ids: bool = False  # vLLM extension: choices (and chunks) carry the generated token ids
    cache_salt: str | None = None  # vLLM extension: prefix-cache blocks are shared only with the same salt
    # vLLM extension: each prompt token's logprob and the top k there (the response's `prompt_logprobs`)
    prompt_logprobs: int | None = None
    priority: int = 0  # vLLM extension: lower runs earlier, with --scheduling_policy priority (else only 0)
    # constrained output: OpenAI's {"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema":
    # ..., "strict": ...}} ({"type": "text"}: none), or vLLM's `structured_outputs` ({"json" | "regex" |
    # "choice" | "grammar" | "json_object": ...}); at most one of the two
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused
    # OpenAI arguments the engine does not implement: refused unless neutral
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingRequest):
    # text, a batch of texts, token ids, or a batch of token-id lists
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top alternatives per token, up to request_mapping.max_logprobs(engine)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None  # None: up to max_model_len
    logprobs: bool = False
    top_logprobs: int | None = None  # as CompletionRequest.logprobs
    echo: bool = False  # vLLM extension: a last assistant message's content starts the reply's content
    tools: list[Any] | None = None
    tool_choice: Any = None


# ---- responses ------------------------------------------------------------------------
# Extensions and stream-only fields are left out when unset rather than sent as null.
def _omit_if_none():
    return Field(default=None, exclude_if=lambda v: v is None)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # with echo, None for the first prompt token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None] | None  # per token, the top alternatives (when logprobs >= 1)
    text_offset: list[int]


class PromptLogprob(BaseModel):  # vLLM's Logprob, in `prompt_logprobs` keyed by token id
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omit_if_none()  # with return_token_ids (in a chunk: the new ones)
    prompt_token_ids: list[int] | None = _omit_if_none()  # with return_token_ids and echo (vLLM's)
    # with prompt_logprobs: per prompt token, None first, then {token id: PromptLogprob}
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _omit_if_none()


class CompletionResponse(BaseModel):  # also each streamed chunk
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omit_if_none()  # in a stream: only the last chunk (include_usage)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omit_if_none()  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = _omit_if_none()  # vLLM's, when asked


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omit_if_none()  # with return_token_ids: the tokens new in this chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = _omit_if_none()  # only the last chunk (include_usage)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "paged_jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
