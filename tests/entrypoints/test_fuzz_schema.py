"""Schema fuzzing (experiments/benchmarks/schema_fuzz.py) of the shared live server, and of a
server built to fail, to show the driver reports what it should.

Every operation of the server's /openapi.json is driven by schemathesis (positive and
negative cases, the API key sent with each): no 5xx, no hang, every 4xx in OpenAI's
error shape, JSON where JSON is documented, no schema-violating case served; afterwards
nothing leaked and greedy answers still equal the engine's offline ones. The default run
is bounded (a few cases per operation, well under a minute here); the slow one sends
more, on another seed.
"""

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from experiments.benchmarks.schema_fuzz import FuzzConfig, bound_generation_cost, fuzz, load_schema, served_greedy
from experiments.benchmarks.schema_fuzz_checks import error_shape_problem, judge, sse_problem
from paged_jax.baselines import reference
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
from tests.helpers.greedy_check import assert_greedy_match
from tests.helpers.server_harness import API_KEY, CHAT_MESSAGES, COMPLETION_PROMPTS, MODEL


def _describe(report) -> str:
    lines = []
    for label, op in report.operations.items():
        for g in op.failures:
            lines.append(f"{label}: {g.kind} x{g.count} ({g.status}) {g.detail}\n    {g.reproducer}")
        for g in op.negative_accepted:
            lines.append(f"{label}: a negative case was served ({g.detail}) x{g.count}\n    {g.reproducer}")
    return "\n".join(lines)


def _fuzz_and_check(live, config: FuzzConfig) -> None:
    spec, schema = load_schema(live.base_url, API_KEY)
    labels = {r.ok().label for r in schema.get_all_operations()}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
            "GET /v1/models", "GET /health", "GET /metrics", "GET /tokenizer_info"} <= labels
    report = fuzz(live.base_url, API_KEY, config, prepare=bound_generation_cost)
    assert report.num_failures == 0, _describe(report)
    assert not any(op.negative_accepted for op in report.operations.values()), _describe(report)
    assert set(report.operations) == labels
    untried = [label for label, op in report.operations.items() if op.cases == 0]
    assert not untried, f"operations never tried: {untried}"
    assert not [op.stopped_by for op in report.operations.values() if "generation" in op.stopped_by]
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        op = report.operations[label]
        assert op.by_mode["positive"] and op.by_mode["negative"], (label, op.by_mode)
        assert op.status_classes.get("2xx") and op.status_classes.get("4xx"), (label, op.status_classes)
    live.assert_all_blocks_free()
    _assert_greedy_still_offline(live)


def _assert_greedy_still_offline(live) -> None:
    """The engine after the fuzz: greedy completion and chat answers equal the offline run's."""
    logits = lambda p: reference.prompt_logits(live.loaded.params, live.loaded.config, [p])[0][-1]
    served = {"completion-0": served_greedy(live.base_url, API_KEY, MODEL, prompt=COMPLETION_PROMPTS[0]),
              "chat-0": served_greedy(live.base_url, API_KEY, MODEL, messages=CHAT_MESSAGES[0])}
    for key, got in served.items():
        assert got["status"] == 200, got
        want = live.offline[key]
        assert_greedy_match(want.prompt_token_ids, want.outputs[0].token_ids, got["token_ids"], logits)
        if got["token_ids"] == want.outputs[0].token_ids:
            assert got["text"] == want.outputs[0].text and got["finish_reason"] == want.outputs[0].finish_reason


def test_fuzzing_every_endpoint_finds_nothing_and_the_engine_still_answers(live_server):
    _fuzz_and_check(live_server, FuzzConfig(max_examples=10, seconds=50, request_timeout_s=60, seed=0))


@pytest.mark.slow
def test_a_longer_fuzz_on_another_seed(live_server):
    _fuzz_and_check(live_server, FuzzConfig(max_examples=150, seconds=600, request_timeout_s=60, seed=1))


# ---- the driver can fail ---------------------------------------------------------------
class _Item(BaseModel):
    x: int
    flag: bool = False


def _failing_app() -> FastAPI:
    """One route per failure kind the driver must report (on inputs it is sure to generate),
    and one that keeps the contract."""
    app = FastAPI()

    @app.post("/boom")
    async def boom(item: _Item):
        if item.x < 0:
            raise RuntimeError("negative")  # starlette's plain-text 500
        return {"x": item.x}

    @app.post("/shape")
    async def shape(item: _Item):
        return JSONResponse({"detail": "FastAPI's shape, not OpenAI's"}, status_code=400)

    @app.get("/text", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}}})
    async def text():
        return PlainTextResponse("not JSON")

    @app.post("/slow")
    async def slow(item: _Item):
        if item.flag:
            import asyncio
            await asyncio.sleep(5)
        return {"x": item.x}

    @app.post("/fine")
    async def fine(item: _Item):
        return {"x": item.x}

    return app


def test_the_driver_reports_each_kind_of_failure():
    server = BackgroundServer(_failing_app())
    try:
        report = fuzz(server.base_url, None, FuzzConfig(max_examples=16, seconds=60, request_timeout_s=1.0,
                                                        negative=False, seed=0))
        budget = fuzz(server.base_url, None, FuzzConfig(max_examples=100_000, seconds=3, operations=("POST /fine",)))
    finally:
        server.stop()
    [fine] = budget.operations.values()
    assert fine.stopped_by == "time" and 1 < fine.cases < 100_000 and fine.seconds < 15, fine
    kinds = {label: {g.kind for g in op.failures} for label, op in report.operations.items()}
    assert "server_error" in kinds["POST /boom"], kinds
    [boom] = [g for g in report.operations["POST /boom"].failures if g.kind == "server_error"]
    assert boom.status == 500 and boom.reproducer["body"]["x"] < 0 and boom.reproducer["method"] == "POST"
    assert boom.reproducer["path"] == "/boom" and "Internal Server Error" in boom.reproducer["response"]
    assert kinds["POST /shape"] == {"error_shape"}
    assert "not_json" in kinds["GET /text"]
    [slow] = [g for g in report.operations["POST /slow"].failures if g.kind == "timeout"]
    assert slow.reproducer["body"]["flag"] is True and slow.reproducer["status"] is None
    assert kinds["POST /fine"] == set() and report.operations["POST /fine"].cases > 1
    assert report.num_failures == sum(g.count for op in report.operations.values() for g in op.failures) > 0


def test_the_response_checks():
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert error_shape_problem(good) is None
    assert error_shape_problem({"detail": "x"}) and error_shape_problem({"error": {"message": "m"}})
    assert error_shape_problem({"error": {**good["error"], "message": ""}})
    assert sse_problem('data: {"a": 1}\n\ndata: [DONE]\n\n') is None
    assert "[DONE]" in sse_problem('data: {"a": 1}\n\n')  # cut short
    assert "error event" in sse_problem('data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n')
    assert "not JSON" in sse_problem("data: NaN\n\ndata: [DONE]\n\n")
    assert "U+2028" in sse_problem('data: {"a": "x\u2028y"}\n\ndata: [DONE]\n\n')  # iter_lines would cut it
    assert sse_problem('data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n') is None
    json_200 = {"application/json": {"type": "object", "required": ["a"]}}
    assert judge(200, "application/json", b'{"a": 1}', json_200, {}) == []
    assert [k for k, _ in judge(200, "application/json", b'{"b": 1}', json_200, {})] == ["response_schema"]
    assert [k for k, _ in judge(200, "text/plain", b"x", json_200, {})] == ["content_type", "not_json"]
    assert [k for k, _ in judge(503, "application/json", b"{}", {}, {})] == ["server_error"]


def test_bound_generation_cost_keeps_negative_cases_negative():
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500.0, "n": 100}
    assert bound_generation_cost("POST", "/v1/completions", body) == {**body, "max_tokens": 4, "n": 2}
    assert bound_generation_cost("POST", "/v1/chat/completions", {"messages": []})["max_completion_tokens"] == 4
    assert bound_generation_cost("POST", "/v1/completions", {"prompt": "x"})["max_tokens"] == 4  # not 16
    for outside in ({"max_tokens": -1}, {"max_tokens": "many"}, {"n": 129}, {"n": 0}, {"max_tokens": 5.5}):
        assert bound_generation_cost("POST", "/v1/completions", {"max_tokens": 1, **outside}).items() >= \
            outside.items()
    assert bound_generation_cost("POST", "/tokenize", {"max_tokens": 500}) == {"max_tokens": 500}
