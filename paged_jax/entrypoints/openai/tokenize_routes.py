"""vLLM's /tokenize, /detokenize and /tokenizer_info: what a prompt costs in tokens, and back again.

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                       "add_special_tokens": false, "return_token_strs": false}
                   -> {"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> {"tokenizer_class", "eos_token", "bos_token", "pad_token", "unk_token",
                             "chat_template", "model_max_length", "vocab_size"}

/tokenizer_info is what lm-evaluation-harness's remote tokenizer (its default against a
server that has it) reads before it counts tokens through /tokenize.

"model" is optional in both; when given it must be the served name (the same 404 as
/v1/completions). Both are behind --api_key as /v1 is (HTTPGuards guards the /v1 prefix
only, so the key is checked here, before the body is read), and bodies go through the
app's own `parse_body` (JSON whatever the Content-Type, finite numbers, no lone
surrogates, strict types), so every bad body is a 400 in OpenAI's error shape.

The token ids are the ones the completion routes would hand the engine: a text prompt is
encoded by request_mapping.prompt_token_ids and messages are rendered by
request_mapping.chat_messages + chat_prompt_ids, the /v1/chat/completions path itself.
The request's options reach those functions through `_TokenizerOptions`, a view of the
server's tokenizer that adds them to its `encode` and `apply_chat_template` calls; with
the defaults nothing is added and the calls are exactly the routes'. Like those routes,
the work runs on the app's tokenizer thread (`run_tokenizer`): never on the engine
thread, never on the event loop.

The request bodies are read by `parse_body`, not by FastAPI, so their models are added
to the OpenAPI schema by hand (openapi_docs.py: each route's `openapi_extra`, and
REQUEST_MODELS, which build_app puts in the document's components).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from paged_jax.entrypoints.openai import request_mapping as rm
from paged_jax.entrypoints.openai.errors import APIError, bad_request
from paged_jax.entrypoints.openai.http_guards import bearer_key_matches
from paged_jax.entrypoints.openai.openapi_docs import body_doc, responses
from paged_jax.entrypoints.openai.protocol import LIMIT, TOKEN_ID, ChatMessage

PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
_MODEL = {"anyOf": [{"type": "string", LIMIT: "served_model"}, {"type": "null"}]}


class _Strict(BaseModel):  # as protocol.py's requests: no coercion, unknown fields ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeCompletionRequest(_Strict):
    model: Annotated[str | None, WithJsonSchema(_MODEL)] = Field(None, description="if given, the served model's name")
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions encodes a text prompt
    return_token_strs: bool = False


_NULL_ONLY = WithJsonSchema({"type": "null", "description": "not supported: null only"})


class TokenizeChatRequest(_Strict):
    # continue_final_message leaves the last (assistant) message open: not with a generation prompt
    model_config = ConfigDict(json_schema_extra={"allOf": [{
        "if": {"required": ["continue_final_message"], "properties": {"continue_final_message": {"const": True}}},
        "then": {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}}}]})
    model: Annotated[str | None, WithJsonSchema(_MODEL)] = Field(None, description="if given, the served model's name")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # as /v1/chat/completions renders
    continue_final_message: bool = False  # leave the last (assistant) message open instead
    add_special_tokens: bool = False  # the template already has them: not added again
    return_token_strs: bool = False
    # vLLM arguments this server cannot honour: refused unless null (as /v1/chat/completions' tools)
    chat_template: Annotated[str | None, _NULL_ONLY] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, _NULL_ONLY] = None
    tools: Annotated[list[Any] | None, _NULL_ONLY] = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: Annotated[str | None, WithJsonSchema(_MODEL)] = Field(None, description="if given, the served model's name")
    tokens: Annotated[list[int], WithJsonSchema({"type": "array", "items": TOKEN_ID})]


class TokenizerInfo(BaseModel):  # GET /tokenizer_info (documentation: the route answers a dict)
    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    chat_template: str | None
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None


REQUEST_MODELS = [TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest]  # for install_openapi


class DetokenizeResponse(BaseModel):
    prompt: str


class _TokenizeBody:
    """What `parse_body` validates a /tokenize body with: the chat form when it has
    "messages", else the prompt form (so a bad body's message names the form's fields)."""

    @staticmethod
    def model_validate(data: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
        model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        return model.model_validate(data)


class _TokenizerOptions:
    """The server's tokenizer with a request's options added to `encode` and
    `apply_chat_template` (overriding the caller's values); everything else is the
    tokenizer's own."""

    def __init__(self, tokenizer, *, encode: dict | None = None, template: dict | None = None):
        self._tokenizer, self._encode, self._template = tokenizer, encode or {}, template or {}

    def encode(self, text, **kwargs):
        return self._tokenizer.encode(text, **{**kwargs, **self._encode})

    def apply_chat_template(self, conversation, **kwargs):
        return self._tokenizer.apply_chat_template(conversation, **{**kwargs, **self._template})

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after one sequence when it adds special
    tokens (e.g. ([bos], []), or ([], []) for SmolLM2), as `encode` adds them."""
    plain = [int(t) for t in tokenizer.encode("a", add_special_tokens=False)]
    full = [int(t) for t in tokenizer.encode("a", add_special_tokens=True)]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []  # not a wrapping of the text: leave the ids as the template made them


def _tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer) -> tuple[list[int], list[str] | None]:
    """Blocking (a long prompt takes tens of ms): on the tokenizer thread."""
    if isinstance(body, TokenizeChatRequest):
        template = {}
        if not body.add_generation_prompt:
            template["add_generation_prompt"] = False
        if body.continue_final_message:
            template["continue_final_message"] = True
        view = _TokenizerOptions(tokenizer, template=template) if template else tokenizer
        ids = rm.chat_prompt_ids(rm.chat_messages(body), view)
        if body.add_special_tokens:
            before, after = _special_tokens_around(tokenizer)
            ids = before + ids + after
    else:
        view = tokenizer if body.add_special_tokens else _TokenizerOptions(tokenizer,
                                                                           encode={"add_special_tokens": False})
        [ids] = rm.prompt_token_ids([body.prompt], view)
    strs = [str(s) for s in tokenizer.convert_ids_to_tokens(ids)] if body.return_token_strs else None
    return ids, strs


def _check_chat(body: TokenizeChatRequest) -> None:
    if body.add_generation_prompt and body.continue_final_message:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true (set "
                          "add_generation_prompt to false to continue the final message)", "continue_final_message")
    for name in ("chat_template", "chat_template_kwargs", "tools"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported by this server (only null)", name)


def _detokenize(tokens: list[int], tokenizer) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


def _api_key_dependency(api_key: str | None):
    """The check HTTPGuards makes on /v1, with the same 401."""
    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        if not bearer_key_matches(request.headers.get("authorization", ""), api_key):
            raise APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return require_api_key


def register_tokenize_routes(app: FastAPI, engine, *, api_key: str | None,
                             parse_body: Callable[[Request, Any], Awaitable[Any]],
                             check_model: Callable[[str], None],
                             run_tokenizer: Callable[..., Awaitable[Any]]) -> None:
    """Add /tokenize and /detokenize to `app` (build_app's `parse_body`, `check_model` and
    tokenizer-thread runner), tokenizing with `engine.tokenizer`."""
    tokenizer = engine.tokenizer
    max_model_len = engine.config.max_model_len
    vocab_size = engine.model_config.vocab_size
    router = APIRouter(dependencies=[Depends(_api_key_dependency(api_key))])

    def check(body) -> None:
        if body.model is not None:
            check_model(body.model)
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so /tokenize and /detokenize are unavailable")

    @router.post("/tokenize", response_model=TokenizeResponse, responses=responses(400, 401, 404, 413),
                 openapi_extra=body_doc(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(request: Request) -> TokenizeResponse:
        """Token ids of a prompt, or of messages rendered as /v1/chat/completions renders them."""
        body = await parse_body(request, _TokenizeBody)
        if isinstance(body, TokenizeChatRequest):
            _check_chat(body)
        check(body)
        ids, strs = await run_tokenizer(_tokenize, body, tokenizer)
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=responses(400, 401, 404, 413),
                 openapi_extra=body_doc(DetokenizeRequest))
    async def detokenize(request: Request) -> DetokenizeResponse:
        """The text of token ids (special tokens included)."""
        body = await parse_body(request, DetokenizeRequest)
        check(body)
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await run_tokenizer(_detokenize, body.tokens, tokenizer))

    @router.get("/tokenizer_info", response_model=None, responses=responses(400, 401, ok=TokenizerInfo))
    async def tokenizer_info() -> dict:
        """The served tokenizer's special tokens and chat template (vLLM's endpoint)."""
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so /tokenizer_info is unavailable")
        return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len,
                "vocab_size": vocab_size, "chat_template": getattr(tokenizer, "chat_template", None),
                **{name: getattr(tokenizer, name, None) for name in ("eos_token", "bos_token", "pad_token",
                                                                    "unk_token")}}

    app.include_router(router)
