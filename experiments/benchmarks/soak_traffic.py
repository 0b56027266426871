"""The soak's traffic: a seeded plan of mixed OpenAI requests and the async clients that send it.

Hours of serving compressed into minutes: requests arrive as a Poisson process, half
/v1/completions (text or token-id prompts) and half /v1/chat/completions, streamed or
not, greedy or sampled with a seed, n of 1..3 (completions sometimes with best_of == n),
stop strings, top logprobs, and a handful of long shared prefixes (a completion's
preamble, a chat's system message) so that the prefix cache both hits and evicts. A few
clients go away: a stream closed after its first tokens, a whole-response request given
up after a moment. Each request asks for `return_token_ids`, so its answer can be
checked token for token against the offline engine (soak_checks.py), and every request
knows the prompt token ids the server must have seen (the client tokenizes as the server
does: `tokenizer.encode`, or the chat template).

A few requests are beam searches (`use_beam_search` with n = 2..max_n beams, no stop strings
or logprobs, which beams refuse); their answers arrive whole at the end, so only a
whole-response client gives up on one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches under a "
          "pale moon near the old river bridge and every baker in town sells warm bread to tired sailors who "
          "sing about distant islands storms maps lanterns and the slow tides of winter").split()
_TOPICS = ("rivers", "prime numbers", "bread", "volcanoes", "sorting", "tides", "jazz", "glaciers", "bridges",
           "owls", "compilers", "tea", "comets", "maps", "bees", "clocks")
STOPS = (["\n"], ["."], [" the", "\n\n"], [","], ["Question"])


@dataclasses.dataclass
class SoakRequest:
    index: int
    arrival: float  # seconds after the start
    endpoint: str  # "completions" | "chat"
    stream: bool
    n: int
    temperature: float  # 0: greedy (checked against offline greedy); > 0: seeded (checked against a replay)
    seed: int | None
    max_tokens: int
    stop: list[str] | None
    ignore_eos: bool
    prompt_token_ids: list[int]  # what the server must see (tokenized here as the server does)
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict] | None = None  # chat
    prefix: int | None = None  # which shared prefix the prompt starts with (None: none)
    logprobs: int | None = None  # top alternatives asked for
    best_of: bool = False  # completions: send best_of == n
    # None | "stream": close the stream after `disconnect_after` chunks with tokens |
    # "wait": a whole-response request given up after `disconnect_after` ms
    disconnect: str | None = None
    disconnect_after: int = 1
    beam: bool = False  # use_beam_search with n beams (greedy; checked against the offline beam search)

    @property
    def sampling(self) -> str:
        if self.beam:
            return "beam"
        return "greedy" if self.temperature == 0 else "seeded"

    def body(self, model: str) -> dict:
        body = {"model": model, "n": self.n, "temperature": self.temperature, "stream": self.stream,
                "return_token_ids": True, "ignore_eos": self.ignore_eos}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.beam:
            body["use_beam_search"] = True
        if self.stop:
            body["stop"] = self.stop if len(self.stop) > 1 or self.index % 2 else self.stop[0]
        if self.stream and self.index % 3:
            body["stream_options"] = {"include_usage": True}
        if self.endpoint == "completions":
            body.update(prompt=self.prompt, max_tokens=self.max_tokens)
            if self.best_of:
                body["best_of"] = self.n
            if self.logprobs is not None:
                body["logprobs"] = self.logprobs
        else:
            body["messages"] = self.messages
            body["max_completion_tokens" if self.index % 2 else "max_tokens"] = self.max_tokens
            if self.logprobs is not None:
                body.update(logprobs=True, top_logprobs=self.logprobs)
        return body


@dataclasses.dataclass
class SoakResult:
    index: int
    status: int | None = None  # HTTP status (None: no response, e.g. a client that gave up first)
    error: str | None = None  # a non-200 body, an error event in a stream, or a client exception
    choices: dict[int, dict] = dataclasses.field(default_factory=dict)  # index -> token_ids, text, finish_reason
    usage: dict | None = None
    disconnected: bool = False  # the client went away on purpose (not checked, must be aborted)
    tokens_seen: int = 0  # generated tokens the client received
    latency: float = 0.0
    done: bool = False  # a complete answer ([DONE] seen, or a whole response)


def _words(rng, n: int) -> str:
    return " ".join(_WORDS[int(i)] for i in rng.integers(len(_WORDS), size=n))


def shared_prefixes(num: int, num_words: int, seed: int) -> list[str]:
    """`num` distinct long system prompts (numbered rules), ~1.4 tokens per word."""
    rng = np.random.default_rng(seed + 7919)
    out = []
    for p in range(num):
        lines = [f"You are assistant number {p}. Follow every rule below when you answer."]
        i = 0
        while sum(len(x.split()) for x in lines) < num_words:
            topic = _TOPICS[int(rng.integers(len(_TOPICS)))]
            lines.append(f"Rule {p}.{i}: when asked about {topic}, answer plainly and mention {_words(rng, 3)}.")
            i += 1
        out.append("\n".join(lines))
    return out


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """As the server renders a chat (request_mapping.chat_prompt_ids)."""
    return [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)]


def make_plan(num_requests: int, *, rate: float, tokenizer, seed: int = 0, max_model_len: int = 512,
              min_tokens: int = 4, max_tokens: int = 24, num_prefixes: int = 4, prefix_words: int = 70,
              disconnect_fraction: float = 0.04, max_n: int = 3, long_words: tuple[int, int] = (60, 150),
              beam_fraction: float = 0.04) -> list[SoakRequest]:
    """A seeded request mix (see the module docstring); arrivals Poisson at `rate` per second.
    `long_words`: the word range of the long unique prompts (1 in 10; they fill the KV
    cache). Every prompt + max_tokens fits max_model_len. Disconnecting requests stream with
    ignore_eos and max_tokens >= 16, so they are certainly unfinished when the client leaves."""
    rng = np.random.default_rng(seed)
    prefixes = shared_prefixes(num_prefixes, prefix_words, seed)
    gaps = rng.exponential(1.0 / rate, size=num_requests) if rate > 0 else np.zeros(num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    plan = []
    for i in range(num_requests):
        endpoint = "completions" if rng.random() < 0.5 else "chat"
        shape = rng.random()  # 55% shared prefix, 10% long unique, 35% short
        prefix = int(rng.integers(num_prefixes)) if shape < 0.55 else None
        topic = _TOPICS[int(rng.integers(len(_TOPICS)))]
        if shape < 0.55:
            body = f"Question {i}: what does the rule about {topic} say? {_words(rng, int(rng.integers(2, 12)))}"
        elif shape < 0.65:
            body = f"Story {i}: " + _words(rng, int(rng.integers(*long_words)))
        else:
            body = f"Note {i} on {topic}: " + _words(rng, int(rng.integers(1, 25)))
        greedy = rng.random() < 0.6
        disconnect = None
        if rng.random() < disconnect_fraction:
            disconnect = "stream" if rng.random() < 0.75 else "wait"
        stream = disconnect == "stream" or (disconnect is None and rng.random() < 0.5)
        n = 1 if rng.random() < 0.75 else int(rng.integers(2, max_n + 1))
        req = SoakRequest(
            index=i, arrival=float(arrivals[i]), endpoint=endpoint, stream=stream, n=n,
            temperature=0.0 if greedy else float(np.round(rng.uniform(0.6, 1.1), 2)),
            seed=None if greedy else int(rng.integers(2**31)),
            max_tokens=int(rng.integers(min_tokens, max_tokens + 1)), stop=None, ignore_eos=False,
            prompt_token_ids=[], prefix=prefix, disconnect=disconnect,
            logprobs=int(rng.integers(0, 4)) if rng.random() < 0.1 else None)
        if disconnect is not None:
            req.ignore_eos, req.max_tokens = True, max(req.max_tokens, 16)
            req.disconnect_after = 1 if disconnect == "stream" else int(rng.integers(20, 200))  # chunks / ms
        elif rng.random() < 0.2:
            req.stop = list(STOPS[int(rng.integers(len(STOPS)))])
        if endpoint == "completions":
            text = (prefixes[prefix] + "\n\n" + body + "\nAnswer:") if prefix is not None else body
            ids = [int(t) for t in tokenizer.encode(text)]
            req.prompt = ids if rng.random() < 0.3 else text
            req.best_of = n > 1 and rng.random() < 0.5
        else:
            messages = ([{"role": "system", "content": prefixes[prefix]}] if prefix is not None else []) + \
                [{"role": "user", "content": body}]
            req.messages, ids = messages, chat_prompt_ids(tokenizer, messages)
        req.prompt_token_ids = ids
        if disconnect != "stream" and max_n >= 2 and rng.random() < beam_fraction:  # a beam search instead
            req.beam, req.n, req.temperature, req.seed = True, int(rng.integers(2, max_n + 1)), 0.0, None
            req.stop, req.logprobs, req.best_of = None, None, False
        if len(ids) + req.max_tokens > max_model_len:
            raise ValueError(f"request {i}: {len(ids)} prompt tokens + {req.max_tokens} exceed max_model_len "
                             f"{max_model_len} (fewer --prefix_words)")
        plan.append(req)
    return plan


# ---- clients --------------------------------------------------------------------------
def _merge_choice(result: SoakResult, choice: dict, chat: bool) -> None:
    c = result.choices.setdefault(choice["index"], {"token_ids": [], "text": "", "finish_reason": None})
    ids = choice.get("token_ids") or []
    c["token_ids"].extend(ids)
    result.tokens_seen += len(ids)
    if chat:
        c["text"] += (choice.get("delta") or {}).get("content") or ""
    else:
        c["text"] += choice.get("text") or ""
    if choice.get("finish_reason") is not None:
        c["finish_reason"] = choice["finish_reason"]


async def _streamed(client, req: SoakRequest, path: str, body: dict, result: SoakResult) -> None:
    chat = req.endpoint == "chat"
    async with client.stream("POST", path, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = f"{response.status_code}: {(await response.aread()).decode()[:300]}"
            return
        token_chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = f"stream error event: {chunk['error'].get('message')}"
                return
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            new = False
            for choice in chunk.get("choices") or []:
                new |= bool(choice.get("token_ids"))
                _merge_choice(result, choice, chat)
            token_chunks += new
            if req.disconnect == "stream" and token_chunks >= req.disconnect_after:
                result.disconnected = True
                return  # leaving the context closes the connection mid-stream


async def _whole(client, req: SoakRequest, path: str, body: dict, result: SoakResult) -> None:
    if req.disconnect == "wait":
        try:
            response = await asyncio.wait_for(client.post(path, json=body), timeout=req.disconnect_after / 1000)
        except asyncio.TimeoutError:
            result.disconnected = True
            return
        # answered before the client gave up: an ordinary answer (checked like any other)
    else:
        response = await client.post(path, json=body)
    result.status = response.status_code
    if response.status_code != 200:
        result.error = f"{response.status_code}: {response.text[:300]}"
        return
    data = response.json()
    result.usage = data.get("usage")
    for choice in data["choices"]:
        c = {"token_ids": list(choice.get("token_ids") or []), "finish_reason": choice.get("finish_reason"),
             "text": choice["message"]["content"] if req.endpoint == "chat" else choice["text"]}
        result.choices[choice["index"]] = c
        result.tokens_seen += len(c["token_ids"])
    result.done = True


async def send(client, req: SoakRequest, model: str) -> SoakResult:
    """One request; never raises (a failure is recorded in the result)."""
    result = SoakResult(req.index)
    path = "/v1/completions" if req.endpoint == "completions" else "/v1/chat/completions"
    start = time.perf_counter()
    try:
        if req.stream:
            await _streamed(client, req, path, req.body(model), result)
        else:
            await _whole(client, req, path, req.body(model), result)
        if not (result.done or result.disconnected or result.error):
            result.error = "the stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - a failed request is a finding, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    return result


async def run_traffic(base_url: str, plan: list[SoakRequest], *, model: str, api_key: str | None = None,
                      max_concurrency: int = 64, on_done=None, request_timeout: float = 600) -> list[SoakResult]:
    """Send the plan at its arrival times (at most `max_concurrency` in flight: later arrivals
    wait their turn, as clients of a saturated server would); `on_done(result)` after each."""
    import httpx

    semaphore = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(client, req):
        async with semaphore:
            result = await send(client, req, model)
        if on_done is not None:
            on_done(result)
        return result

    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(request_timeout)) as client:
        start = time.perf_counter()
        tasks = []
        for req in plan:
            delay = req.arrival - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, req)))
        return list(await asyncio.gather(*tasks))
