"""The OpenAI-compatible server, end to end over loopback with the official `openai` client.

Greedy answers (whole and streamed, completions and chat) equal the engine's offline
output on the same prompts; 64 concurrent requests batch together and all match; a
client that goes away mid-request is aborted and its blocks freed; /metrics parses and
moves; shutdown aborts what is running and stops the engine thread. Bad input is in
test_server_errors.py; the server fixture is in server_harness.py.
"""

import asyncio
import dataclasses
import functools
import json

import httpx
import pytest

from paged_jax.baselines import reference
from paged_jax.entrypoints.openai.request_mapping import max_logprobs
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
from tests.helpers.greedy_check import assert_greedy_match
from tests.helpers.server_harness import API_KEY, CHAT_MESSAGES, COMPLETION_PROMPTS, MODEL, STOP_PROMPT, STOPS, load_prompts

AUTH = {"Authorization": f"Bearer {API_KEY}"}
IDS = {"return_token_ids": True}


def assert_matches_offline(live, want, ids, text, finish_reason):
    """Greedy ids equal the offline run's (up to a checked near-tie); then text and reason too."""
    w = want.outputs[0]
    logits = lambda p: reference.prompt_logits(live.loaded.params, live.loaded.config, [p])[0][-1]
    assert_greedy_match(want.prompt_token_ids, w.token_ids, ids, logits)
    if list(ids) == w.token_ids:
        assert text == w.text
        assert finish_reason == w.finish_reason


def collect_stream(chunks, chat: bool):
    """Assemble streamed chunks: {index: [text, ids, finish_reason]}, usage."""
    choices, usage = {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            entry = choices.setdefault(c.index, ["", [], None])
            entry[0] += (c.delta.content or "") if chat else c.text
            entry[1] += getattr(c, "token_ids", None) or []
            entry[2] = c.finish_reason or entry[2]
    return choices, usage


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_offline(live_server, stream):
    client = live_server.openai()
    # a batch of prompts in one request: choice i answers prompt i
    kwargs = dict(model=MODEL, prompt=COMPLETION_PROMPTS, max_tokens=16, temperature=0, extra_body=IDS)
    if stream:
        choices, usage = collect_stream(client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs), chat=False)
    else:
        r = client.completions.create(**kwargs)
        choices, usage = {c.index: (c.text, c.token_ids, c.finish_reason) for c in r.choices}, r.usage
    assert sorted(choices) == list(range(len(COMPLETION_PROMPTS)))
    wants = [live_server.offline[f"completion-{i}"] for i in range(len(COMPLETION_PROMPTS))]
    for want, (text, ids, reason) in zip(wants, (choices[i] for i in sorted(choices))):
        assert_matches_offline(live_server, want, ids, text, reason)
    assert usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    assert usage.completion_tokens == sum(len(c[1]) for c in choices.values())
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline(live_server, stream):
    client = live_server.openai()
    for i, messages in enumerate(CHAT_MESSAGES):
        want = live_server.offline[f"chat-{i}"]
        kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0, extra_body=IDS)
        if stream:
            choices, usage = collect_stream(client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs), chat=True)
            [(text, ids, reason)] = choices.values()
        else:
            r = client.chat.completions.create(**kwargs)
            [c] = r.choices
            assert c.message.role == "assistant"
            text, ids, reason, usage = c.message.content, c.token_ids, c.finish_reason, r.usage
        assert_matches_offline(live_server, want, ids, text, reason)
        assert usage.prompt_tokens == len(want.prompt_token_ids) and usage.completion_tokens == len(ids)
    assert "Paris" in live_server.offline["chat-0"].outputs[0].text


def test_stream_wire_format_ends_with_done(live_server):
    for path, body, kind in [
            ("/v1/completions", {"prompt": "1, 2, 3,"}, "text_completion"),
            ("/v1/chat/completions", {"messages": CHAT_MESSAGES[0]}, "chat.completion.chunk")]:
        body = dict(body, model=MODEL, max_tokens=4, temperature=0, stream=True,
                    stream_options={"include_usage": True})
        with httpx.stream("POST", live_server.base_url + path, json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {kind}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        if kind == "chat.completion.chunk":
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_64_concurrent_requests_batch_together_and_equal_offline(live_server):
    cases = load_prompts()

    async def one(client, i, prompt, max_tokens):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=IDS)
        if i % 2:
            choices, _ = collect_stream([c async for c in await client.completions.create(stream=True, **kwargs)],
                                        chat=False)
            return choices[0]
        c = (await client.completions.create(**kwargs)).choices[0]
        return c.text, c.token_ids, c.finish_reason

    async def main():
        client = live_server.async_openai(timeout=120)
        return await asyncio.gather(*(one(client, i, p, m) for i, (p, m) in enumerate(cases)))

    before = live_server.metrics()
    results = asyncio.run(main())
    after = live_server.metrics()
    for i, (text, ids, reason) in enumerate(results):
        assert_matches_offline(live_server, live_server.offline[f"load-{i}"], ids, text, reason)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    steps = delta("paged_jax_step_requests_count")
    assert steps > 0
    # batching: some steps advanced more than 8 requests at once (max_num_seqs is 16)
    assert steps - delta("paged_jax_step_requests_bucket", (("le", "8.0"),)) > 0
    finished = sum(delta("paged_jax_request_success_total", (("finished_reason", r),)) for r in ("stop", "length"))
    assert finished == len(cases)
    live_server.assert_all_blocks_free()


def test_client_disconnect_aborts_and_frees_blocks(live_server):
    live_server.wait_idle()
    before = live_server.metrics()
    long = dict(model=MODEL, prompt="Tell me a very long story about a dragon.", max_tokens=400, ignore_eos=True,
                temperature=0)
    # streaming: read three chunks, then hang up
    with httpx.stream("POST", live_server.base_url + "/v1/completions", json=dict(long, stream=True), headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        got = [line for _, line in zip(range(6), events) if line]
        assert got and got[0].startswith("data: ")
    live_server.assert_all_blocks_free()
    # not streaming: give up waiting after a second
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/completions", json=long, headers=AUTH, timeout=1.0)
    live_server.assert_all_blocks_free()
    after = live_server.metrics()
    assert after[("paged_jax_request_aborted_total", ())] - before[("paged_jax_request_aborted_total", ())] == 2
    # the engine stopped them: far fewer steps than the 2 x 400 decode steps they asked for
    assert after[("paged_jax_engine_steps_total", ())] - before[("paged_jax_engine_steps_total", ())] < 200
    assert not live_server.engine.has_unfinished_requests()


def test_n_and_seed(live_server):
    client = live_server.openai()
    kwargs = dict(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=7, max_tokens=6,
                  extra_body=IDS)
    first = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.choices}) > 1  # each completion has its own stream
    streamed, usage = collect_stream(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                               **kwargs), chat=False)
    # the same seed gives the same completions, streamed or not
    assert {i: (t, ids) for i, (t, ids, _) in streamed.items()} == {c.index: (c.text, c.token_ids)
                                                                   for c in first.choices}
    assert usage.completion_tokens == sum(len(c.token_ids) for c in first.choices) == first.usage.completion_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_concatenated_are_the_whole_answer(live_server, chat):
    """A stream sends the engine's DELTA outputs, a whole answer its FINAL_ONLY one: with
    n = 2 seeded samples, stop strings and top logprobs, the chunks concatenated are the
    whole answer (text, token ids, logprobs, finish reasons, usage)."""
    client = live_server.openai()
    kwargs = dict(model=MODEL, n=2, temperature=1.0, seed=3, max_tokens=24, stop=[" the", ", and"], extra_body=IDS)
    if chat:
        create = functools.partial(client.chat.completions.create, messages=CHAT_MESSAGES[0], logprobs=True,
                                   top_logprobs=1, **kwargs)
    else:
        create = functools.partial(client.completions.create, prompt="Once upon a time", logprobs=1, **kwargs)
    whole = create(stream=False)
    chunks = list(create(stream=True, stream_options={"include_usage": True}))
    assert any(c.finish_reason == "stop" for c in whole.choices)  # a stop string cut one (the seed makes it so)
    for choice in whole.choices:
        parts = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
        text = "".join((c.delta.content or "") if chat else c.text for c in parts)
        assert text == (choice.message.content if chat else choice.text)
        assert [t for c in parts for t in getattr(c, "token_ids", None) or []] == choice.token_ids
        assert [c.finish_reason for c in parts if c.finish_reason] == [choice.finish_reason]
        if chat:
            streamed = [(e.token, e.logprob) for c in parts if c.logprobs for e in c.logprobs.content]
            assert streamed == [(e.token, e.logprob) for e in choice.logprobs.content]
        else:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [x for c in parts if c.logprobs for x in getattr(c.logprobs, key)] == getattr(
                    choice.logprobs, key)
    usage = next(chunk.usage for chunk in chunks if chunk.usage is not None)
    assert usage == whole.usage


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_and_are_never_streamed(live_server, stream):
    want = live_server.offline["stop"].outputs[0]
    assert want.finish_reason == "stop" and want.stop_reason in STOPS
    client = live_server.openai()

    def complete(**kwargs) -> tuple[str, str]:
        """(text, finish_reason) of one completion, streamed or whole."""
        kwargs = dict(model=MODEL, prompt=STOP_PROMPT, temperature=0, **kwargs)
        if stream:
            choices, _ = collect_stream(client.completions.create(stream=True, **kwargs), chat=False)
            [(text, _, reason)] = choices.values()
            return text, reason
        c = client.completions.create(**kwargs).choices[0]
        return c.text, c.finish_reason

    text, reason = complete(max_tokens=16, stop=list(STOPS))
    assert (text, reason) == (want.text, "stop")
    assert not any(s in text for s in STOPS)
    # a tail held back as a possible stop (" Paris" could start " Paris is") is sent when the
    # completion ends for another reason
    assert complete(max_tokens=1, stop=[" Paris is great"]) == (" Paris", "length")


def test_logprobs(live_server):
    client = live_server.openai()
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=1, extra_body=IDS)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(c.token_ids) == 6
    assert "".join(lp.tokens) == c.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert top[token] == pytest.approx(logprob, abs=1e-5)  # greedy: the sampled token is the top one
    streamed, _ = collect_stream(client.completions.create(model=MODEL, prompt="The capital of France is",
                                                           max_tokens=6, temperature=0, logprobs=0, stream=True,
                                                           extra_body=IDS), chat=False)
    assert streamed[0][1] == c.token_ids
    if max_logprobs(live_server.engine) >= 2:  # the engine returns alternatives: best first
        r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                      logprobs=2)
        for token, logprob, top in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs,
                                       r.choices[0].logprobs.top_logprobs):
            assert len(top) == 2 and list(top)[0] == token and top[token] == pytest.approx(logprob, abs=1e-5)
            assert list(top.values())[1] <= logprob
    chat = client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES[0], max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(e.logprob <= 0 and e.top_logprobs[0].token == e.token for e in content)


def test_models_and_health(live_server):
    models = live_server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(live_server.base_url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_parse_and_move(live_server, stream):
    """Streamed (DELTA outputs) or whole (one FINAL_ONLY output), a request's tokens and
    latencies are counted per engine step."""
    live_server.wait_idle()
    before = live_server.metrics()
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(live_server.openai().completions.create(stream=True, stream_options={"include_usage": True},
                                                               **kwargs))
        r = next(c for c in chunks if c.usage is not None)
    else:
        r = live_server.openai().completions.create(**kwargs)
    after = live_server.metrics()

    def delta(name, labels=()):
        return after[(name, labels)] - before[(name, labels)]

    assert delta("paged_jax_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("paged_jax_generation_tokens_total") == r.usage.completion_tokens == 5
    assert delta("paged_jax_request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("paged_jax_time_to_first_token_seconds_count") == 1
    assert delta("paged_jax_inter_token_latency_seconds_count") == 4
    assert delta("paged_jax_e2e_request_latency_seconds_count") == 1
    assert delta("paged_jax_engine_steps_total") >= 5
    assert 0 <= after[("paged_jax_kv_cache_usage_perc", ())] <= 1
    for name in ("paged_jax_num_requests_running", "paged_jax_num_requests_waiting", "paged_jax_num_requests_swapped",
                 "paged_jax_prefix_cache_queries_total", "paged_jax_prefix_cache_hits_total",
                 "paged_jax_num_preemptions_total", "paged_jax_num_blocks_cached"):
        assert after[(name, ())] >= 0


def test_shutdown_aborts_running_requests_and_stops_the_engine_thread(live_server):
    """What SIGINT/SIGTERM does (uvicorn's handler sets should_exit), on a second app on the
    same (idle) engine: a long stream gets the grace period, then ends with an error event
    and [DONE]; the engine thread stops and every block is free."""
    from paged_jax.entrypoints.openai import ServerSettings, build_app

    live_server.wait_idle()
    app = build_app(live_server.engine, ServerSettings(served_model_name=MODEL))
    second = BackgroundServer(app, grace=0.5)
    body = dict(model=MODEL, prompt="Count to a thousand:", max_tokens=500, ignore_eos=True, stream=True)
    events = []
    with httpx.stream("POST", second.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3:
                second.server.should_exit = True
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert "shutting down" in error["message"] and error["code"] == "unavailable"
    assert not any('"finish_reason":"length"' in e for e in events)
    second.thread.join(30)
    assert not second.thread.is_alive()
    assert not app.state.engine_loop.alive and not app.state.engine_loop._thread.is_alive()
    assert app.state.metrics.request_aborted._value.get() == 1
    assert not live_server.engine.has_unfinished_requests()
    bm = live_server.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_engine_loop_stop_aborts_what_is_left(live_server):
    """Draining, then stopping the engine loop with a request still running (no HTTP layer
    to cancel it): its handler is told, the engine is left empty, no new request is taken."""
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.openai.engine_loop import EngineLoop, EngineRequest, EngineUnavailable

    live_server.wait_idle()
    request = EngineRequest("stop-test", "Count to a thousand:", SamplingParams(max_tokens=400, ignore_eos=True))

    async def main():
        loop = EngineLoop(live_server.engine)
        loop.start()
        stream = loop.submit([request])
        await stream.accepted()
        await asyncio.wait_for(stream.next(), 60)  # it runs
        loop.drain()  # shutting down: new requests are refused, the running one goes on
        with pytest.raises(EngineUnavailable, match="shutting down"):
            loop.submit([dataclasses.replace(request, request_id="too-late")])
        assert not (await asyncio.wait_for(stream.next(), 60)).finished
        await asyncio.to_thread(loop.stop)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            while True:
                await asyncio.wait_for(stream.next(), 10)
        assert not loop.alive
        with pytest.raises(EngineUnavailable):
            loop.submit([request])

    asyncio.run(main())
    assert not live_server.engine.has_unfinished_requests()
    bm = live_server.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
