"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health, /metrics and the KV-pool /dashboard (dashboard.py), in front of one EngineLoop.

`build_app(engine, settings)` takes an already built LLMEngine (warm-up done), so a test
or a notebook can serve the engine it holds. The engine thread starts with the app's
lifespan and stops with it: on shutdown (uvicorn's SIGINT/SIGTERM handling), requests
still running after uvicorn's graceful timeout are cancelled, and the engine loop
aborts whatever is left, so every handler returns and every block is freed.

Each request: validate (400s) -> tokenize (chat: render the template) -> submit a group
of engine requests (503 when the waiting queue is full) -> wait until the engine
accepted it (a bad prompt is a 400, not a broken stream) -> answer whole or as
server-sent events. A task watches the connection meanwhile: a client that goes away
aborts its request at the next step.

Tokenizing happens here, on one tokenizer thread per app, never on the engine thread or
the event loop: a 100k-character prompt takes tens of milliseconds to encode, which on
the engine thread would stall every running request's next token, and on the event loop
every other connection. One thread, as vLLM's tokenizer executor: the tokenizer's Rust
state is shared, and a queue of long prompts should not take every default-pool thread.
The engine gets token ids only (`{"prompt_token_ids": ids}`, plus the request's
`cache_salt` when it has one), and hands back token ids: each request's text is
detokenized in its own handler, on the event loop (request_stream.py), so the engine
thread runs nothing but the engine core.

If the engine fails (engine_loop.py), requests in flight get a 500 (streams: an error
event, then [DONE]), new ones and /health a 503, and the server shuts down so that the
process exits non-zero (uvicorn_server.py, serve.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from paged_jax.entrypoints.openai import kv_transfer_params as kvt
from paged_jax.entrypoints.openai import request_mapping as rm
from paged_jax.entrypoints.openai import tokenize_routes
from paged_jax.entrypoints.openai.dashboard import DashboardFeed, register_dashboard_routes
from paged_jax.entrypoints.openai.engine_loop import (EngineDead, EngineLoop, EngineRequest, EngineUnavailable,
                                                     QueueFull, RequestAborted)
from paged_jax.entrypoints.openai.errors import (APIError, bad_request, engine_dead, generation_error,
                                                 install_error_handlers, server_busy, unavailable, validation_message)
from paged_jax.entrypoints.openai.http_guards import HTTPGuards
from paged_jax.entrypoints.openai.json_body import parse_json_body
from paged_jax.entrypoints.openai.metrics import RequestRecorder, ServerMetrics
from paged_jax.entrypoints.openai.openapi_docs import body_doc, install_openapi, responses
from paged_jax.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                   CompletionResponse, HealthStatus, ModelCard, ModelList)
from paged_jax.entrypoints.openai.request_stream import RequestStream
from paged_jax.entrypoints.openai.responses import ResponseBuilder

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    served_model_name: str = "smollm2-135m"  # the only name /v1 requests may ask for
    api_key: str | None = None  # when set, every /v1 request needs "Authorization: Bearer <key>"
    max_waiting_requests: int = 256  # waiting sequences (+ not yet queued) before new requests get 503
    max_request_body_bytes: int = 1 << 20  # larger bodies get 413
    dashboard_max_rate: float = 4.0  # /dashboard: KV-pool snapshots per second at most, while someone watches


class _ClientGone(Exception):
    pass


def build_app(engine, settings: ServerSettings | None = None, *, kv_connector=None) -> FastAPI:
    """`kv_connector` (paged_jax/engine/kv_connector.py; the engine built with
    kv_transfer=True): this server takes part in disaggregated prefill / decode
    (kv_transfer_params.py)."""
    settings = settings or ServerSettings()
    if kv_connector is not None and not engine.config.kv_transfer:
        raise ValueError("a KV connector needs an engine built with kv_transfer=True")
    metrics = ServerMetrics(lambda: loop.stats())  # engine state is read at scrape time

    def on_step(outputs) -> None:  # on the engine thread
        metrics.observe_step(outputs)
        dashboard.on_step(outputs)

    loop = EngineLoop(engine, max_waiting_requests=settings.max_waiting_requests, on_step=on_step,
                      on_iteration=lambda: dashboard.on_iteration(), kv_connector=kv_connector)
    dashboard = DashboardFeed(loop, max_rate=settings.dashboard_max_rate)
    created = int(time.time())
    max_model_len = engine.config.max_model_len
    logprobs_limit = rm.max_logprobs(engine)
    tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged_jax-tokenizer")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        dashboard.start()
        loop.start()
        try:
            yield
        finally:
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(loop.stop)

    async def tokenize(fn, *args):
        """fn(*args) on the tokenizer thread; its APIError (a 400) propagates."""
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, fn, *args)

    app = FastAPI(title="paged_jax OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics, app.state.settings = loop, metrics, settings
    app.state.dashboard = dashboard
    install_error_handlers(app, on_api_error=metrics.observe_refusal)
    app.add_middleware(HTTPGuards, api_key=settings.api_key, max_body_bytes=settings.max_request_body_bytes)

    def check_model(name: str) -> None:
        if name != settings.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{settings.served_model_name!r}", param="model", code="model_not_found")

    async def submit(group: list[EngineRequest], prompt_param: str, recorder: RequestRecorder) -> RequestStream:
        num_seqs = sum(r.params.n for r in group)
        if num_seqs > settings.max_waiting_requests:
            raise bad_request(f"the request asks for {num_seqs} sequences (prompts x n); the server queues at most "
                              f"{settings.max_waiting_requests}", "n")
        try:
            stream = loop.submit(group, on_step=recorder.on_step)
        except QueueFull as exc:
            raise server_busy(str(exc)) from exc
        except EngineDead as exc:
            raise engine_dead(exc, in_flight=False) from exc
        except EngineUnavailable as exc:
            raise unavailable(exc) from exc
        try:
            await stream.accepted()
        except ValueError as exc:  # the engine refused a prompt: nothing was queued
            raise bad_request(str(exc), prompt_param) from exc
        except EngineDead as exc:  # it was queued when the engine failed
            raise engine_dead(exc, in_flight=True) from exc
        except EngineUnavailable as exc:
            raise unavailable(exc) from exc
        except BaseException:
            stream.abort()
            raise
        return stream

    async def watch_disconnect(request: Request, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests as soon as the client disconnects."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.abort()
                return

    async def run(request: Request, builder: ResponseBuilder, group: list[EngineRequest], stream_mode: bool,
                  include_usage: bool):
        """Serve the group; a whole answer of an export request carries its kv_transfer_params."""
        recorder = RequestRecorder(metrics, delta=stream_mode)  # streams get DELTA outputs (request_mapping.py)
        stream = await submit(group, "messages" if builder.chat else "prompt", recorder)
        watcher = asyncio.create_task(watch_disconnect(request, stream))
        if not stream_mode:
            try:
                finals = await _collect(stream, recorder)
            except (_ClientGone, RequestAborted):
                return Response(status_code=499)  # nobody is listening
            except EngineDead as exc:  # counted as aborted, not as a refusal: it was accepted
                recorder.abort()
                return engine_dead(exc, in_flight=True).response()
            except EngineUnavailable as exc:  # shutting down: the engine loop aborted the request
                recorder.abort()
                raise unavailable(exc) from exc
            finally:
                watcher.cancel()
                if stream.aborted or not stream.finished:
                    stream.abort()
                    recorder.abort()
            failed = next(filter(None, (generation_error(finals[r.request_id]) for r in group)), None)
            if failed is not None:
                return failed.response()
            answer = builder.response([finals[r.request_id] for r in group])
            if group[0].kv_export:
                answer.kv_transfer_params = (loop.take_kv_transfer_params(group[0].request_id)
                                             or {"do_remote_prefill": True, "connector": None, "num_tokens": 0})
            return JSONResponse(answer.model_dump())
        return StreamingResponse(_sse(stream, recorder, watcher, builder, group, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _collect(stream: RequestStream, recorder: RequestRecorder) -> dict:
        finals = {}
        while not stream.finished:
            out = await stream.next()
            recorder.on_output(out)
            if out.finished:
                finals[out.request_id] = out
        if stream.aborted:
            raise _ClientGone()
        recorder.finish()
        return finals

    async def _sse(stream: RequestStream, recorder: RequestRecorder, watcher: asyncio.Task,
                   builder: ResponseBuilder, group: list[EngineRequest], include_usage: bool):
        finals = {}
        try:
            for chunk in builder.first_chunks(sum(r.params.n for r in group)):
                yield chunk
            while not stream.finished:
                try:
                    out = await stream.next()
                except RequestAborted:
                    return
                except EngineUnavailable as exc:  # shutting down, or the engine failed
                    recorder.abort()
                    error = engine_dead(exc, in_flight=True) if isinstance(exc, EngineDead) else unavailable(exc)
                    yield f"data: {json.dumps(error.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                recorder.on_output(out)
                if (failed := generation_error(out)) is not None:  # a completion failed: no more chunks
                    if stream.finished:
                        recorder.finish()  # counted by finish reason, "error" among them
                    yield f"data: {json.dumps(failed.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if out.finished:
                    finals[out.request_id] = out
                for chunk in builder.chunks(out):
                    yield chunk
            if stream.aborted:
                return
            recorder.finish()
            if include_usage:
                yield builder.usage_chunk([finals[r.request_id] for r in group])
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if stream.aborted or not stream.finished:
                stream.abort()
                recorder.abort()

    async def parse_body(request: Request, model: type[BaseModel]):
        """JSON whatever the Content-Type (curl's default is form-encoded), then strict
        validation; both failures are 400s that say what was wrong."""
        data = parse_json_body(await request.body())
        if not isinstance(data, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise bad_request(message, param) from exc

    # ---- routes --------------------------------------------------------------------------
    generation_errors = (400, 401, 404, 413, 500, 503)

    @app.post("/v1/completions", openapi_extra=body_doc(CompletionRequest),
              responses=responses(*generation_errors, ok=CompletionResponse, stream=True))
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        rm.check_completion(body, logprobs_limit, engine.config.scheduling_policy)
        check_model(body.model)
        max_tokens, prompt_logprobs = rm.completion_echo(body)
        params = rm.request_params(body, max_tokens=max_tokens, default_max_tokens=max_model_len,
                                   logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)
        prompts = rm.completion_prompts(body)
        await tokenize(rm.check_structured_outputs, body, params, engine)
        prompt_ids = await tokenize(rm.prompt_token_ids, prompts, engine.tokenizer)
        per_prompt = [rm.prompt_params(params, max_tokens=max_tokens, num_prompt_tokens=len(ids),
                                       max_model_len=max_model_len, param="max_tokens") for ids in prompt_ids]
        transfer = kvt.mode(body, kv_connector, len(prompt_ids), params.n)
        kv = await kvt.load(kv_connector, body.kv_transfer_params, prompt_ids[0]) if transfer == "import" else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = [EngineRequest(f"{request_id}-{i}", rm.engine_prompt(ids, body.cache_salt), per_prompt[i],
                               body.priority, kv_import=kv, kv_export=transfer == "export")
                 for i, ids in enumerate(prompt_ids)]
        builder = ResponseBuilder(chat=False, request_id=request_id, model=settings.served_model_name,
                                  engine_ids=[r.request_id for r in group], n=params.n, tokenizer=engine.tokenizer,
                                  logprobs=body.logprobs, return_token_ids=body.return_token_ids, echo=body.echo,
                                  echo_only=body.echo and body.max_tokens == 0,
                                  prompt_texts=[q if isinstance(q, str) else None for q in prompts],
                                  prompt_logprobs=body.prompt_logprobs is not None)
        return await run(request, builder, group, body.stream,
                         bool(body.stream_options and body.stream_options.include_usage))

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest),
              responses=responses(*generation_errors, ok=ChatCompletionResponse, stream=True))
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        rm.check_chat(body, logprobs_limit, engine.config.scheduling_policy)
        check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = rm.request_params(body, max_tokens=max_tokens, default_max_tokens=max_model_len, logprobs=logprobs,
                                   prompt_logprobs=body.prompt_logprobs)
        messages = rm.chat_messages(body)
        await tokenize(rm.check_structured_outputs, body, params, engine)
        prompt_ids = await tokenize(rm.chat_prompt_ids, messages, engine.tokenizer)
        params = rm.prompt_params(params, max_tokens=max_tokens, num_prompt_tokens=len(prompt_ids),
                                  max_model_len=max_model_len, param="max_tokens" if body.max_completion_tokens is None
                                  else "max_completion_tokens")
        transfer = kvt.mode(body, kv_connector, 1, params.n)
        kv = await kvt.load(kv_connector, body.kv_transfer_params, prompt_ids) if transfer == "import" else None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = [EngineRequest(f"{request_id}-0", rm.engine_prompt(prompt_ids, body.cache_salt), params,
                               body.priority, kv_import=kv, kv_export=transfer == "export")]
        builder = ResponseBuilder(chat=True, request_id=request_id, model=settings.served_model_name,
                                  engine_ids=[group[0].request_id], n=params.n, tokenizer=engine.tokenizer,
                                  logprobs=logprobs, return_token_ids=body.return_token_ids, echo=body.echo,
                                  prompt_texts=[rm.chat_echo_text(messages)],
                                  prompt_logprobs=body.prompt_logprobs is not None)
        return await run(request, builder, group, body.stream,
                         bool(body.stream_options and body.stream_options.include_usage))

    tokenize_routes.register_tokenize_routes(app, engine, api_key=settings.api_key, parse_body=parse_body,
                                             check_model=check_model, run_tokenizer=tokenize)  # /tokenize, ...

    register_dashboard_routes(app, dashboard, api_key=settings.api_key,
                              served_model_name=settings.served_model_name)  # /dashboard, its snapshots

    @app.get("/v1/models", responses=responses(401))
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.served_model_name, created=created, max_model_len=max_model_len)])

    @app.get("/health", responses={200: {"model": HealthStatus}, 503: {"model": HealthStatus,
                                                                         "description": "shutting down, or the "
                                                                                        "engine failed"}})
    async def health():
        """200 while requests are served; 503 while shutting down and once the engine failed."""
        if loop.error is not None:
            return JSONResponse({"status": "engine_dead", "error": f"{type(loop.error).__name__}: {loop.error}"},
                                status_code=503)
        if not loop.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    install_openapi(app, [CompletionRequest, ChatCompletionRequest, *tokenize_routes.REQUEST_MODELS],
                    limits={"served_model": settings.served_model_name, "logprobs": logprobs_limit,
                            "token_id": _last_token_id(engine),
                            "priority": getattr(engine.config, "scheduling_policy", "fcfs")},
                    protected=("/v1", *tokenize_routes.PATHS), api_key=settings.api_key)
    return app


def _last_token_id(engine) -> int | None:
    """The largest token id a prompt may hold (the OpenAPI document's bound), if known."""
    vocab_size = getattr(getattr(engine, "model_config", None), "vocab_size", None)
    return None if vocab_size is None else int(vocab_size) - 1
