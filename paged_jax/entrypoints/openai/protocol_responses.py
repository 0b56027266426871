"""Response bodies of the OpenAI API subset the server speaks (and /health's), as pydantic models.

Split from protocol.py (the request bodies), which re-exports every name here: the
request side carries the OpenAPI documentation of what the server accepts, this side
what it answers. Extensions and stream-only fields are left out when unset rather than
sent as null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


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
    kv_transfer_params: dict[str, Any] | None = _omit_if_none()  # a prefill server's, for the decode server


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
    kv_transfer_params: dict[str, Any] | None = _omit_if_none()  # a prefill server's, for the decode server


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


class HealthStatus(BaseModel):  # GET /health: 200 {"status": "ok"}, 503 otherwise
    status: Literal["ok", "unavailable", "engine_dead"]
    error: str | None = _omit_if_none()  # with engine_dead: the engine's exception
