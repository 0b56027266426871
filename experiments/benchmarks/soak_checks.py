"""The soak's verification: served answers against the offline engine, /metrics against the
client's own counts, leaks in the engine's bookkeeping, and the process's RSS over time.

Answers. Every answered request (not a disconnected one) is replayed offline on the
server's own engine once the server has stopped: same prompt token ids (the client's
tokenization), same SamplingParams (n, temperature, seed, max_tokens, stop strings,
ignore_eos, logprobs). Each choice's token ids must equal the replay's, and then its text
and finish reason too. A greedy answer may differ only at a near-tie of the reference
(tests/helpers/greedy_check.py, the repository's one rule): there the offline engine's
logits of the two tokens are within 1e-3 (read as the raw logprobs of its top-K, whose
differences are the logits' differences; a token outside the top-K is no tie). A seeded
answer is a Gumbel-max draw, token = argmax(logits / T + g) with g from the completion's
key (fold_in(key(seed), position): worker/step_head.py), so the same rule applies to
those scores: a sampled answer may differ only where they are within 1e-3. A beam search's
beams (use_beam_search) must equal the offline beam search's exactly: no tie rule is
applied to them, so a float-noise swap of two tied hypotheses would count as a mismatch.

Leaks. After the traffic, with the server idle, every block is free or cached, and the
per-request dicts of the core, block manager, runner, scheduler and both output
processors are empty (`bookkeeping`).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from experiments.benchmarks.soak_traffic import SoakRequest, SoakResult


# ---- offline replay -------------------------------------------------------------------
def offline_params(req: SoakRequest):
    from paged_jax.core.beam_search import BeamSearchParams
    from paged_jax.core.sampling_params import SamplingParams
    if req.beam:
        return BeamSearchParams(beam_width=req.n, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
    return SamplingParams(n=req.n, temperature=req.temperature, seed=req.seed, max_tokens=req.max_tokens,
                          stop=tuple(req.stop) if req.stop else None, ignore_eos=req.ignore_eos,
                          logprobs=req.logprobs)


def checkable(result: SoakResult) -> bool:
    return result.done and not result.disconnected and result.error is None


def run_requests(engine, requests: dict, wave: int = 64) -> dict:
    """key -> (prompt token ids, SamplingParams) run on `engine` (an LLMEngine nobody else
    steps), at most `wave` in flight; returns key -> final RequestOutput."""
    keys, finals, active = list(requests), {}, 0
    pending = iter(keys)
    while True:
        while active < wave:
            key = next(pending, None)
            if key is None:
                break
            ids, params = requests[key]
            engine.add_request(f"soak-offline-{key}", {"prompt_token_ids": list(ids)}, params)
            active += 1
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id.removeprefix("soak-offline-")] = out
                active -= 1


class Reference:
    """The offline engine's next-token logits (top-K, as raw logprobs) after a token list."""

    def __init__(self, engine):
        self.engine = engine
        self.vocab_size = engine.model_config.vocab_size
        self.k = engine.config.max_logprobs
        self._cache: dict[tuple, np.ndarray] = {}

    def logits(self, ids) -> np.ndarray:
        """f32[vocab]: -inf outside the top-K (so no token outside it is ever a near-tie)."""
        from paged_jax.core.sampling_params import SamplingParams
        key = tuple(ids)
        if key not in self._cache:
            params = SamplingParams(temperature=0, max_tokens=1, logprobs=self.k, ignore_eos=True)
            [out] = run_requests(self.engine, {"ref": (list(ids), params)}).values()
            row = np.full(self.vocab_size, -np.inf, np.float64)
            for token, lp in out.outputs[0].top_logprobs[0]:
                row[token] = lp
            self._cache[key] = row
        return self._cache[key]

    def sampling_scores(self, ids, prompt_len: int, seed: int, temperature: float) -> np.ndarray:
        """logits / T + the Gumbel noise of draw number len(ids) - prompt_len with `seed`
        (a completion's own seed: engine.core_requests.completion_seed), i.e. what the draw maximizes."""
        import jax
        key = jax.random.fold_in(jax.random.key(np.uint32(seed)), len(ids) - prompt_len)
        gumbel = np.asarray(jax.random.gumbel(key, (self.vocab_size,), np.float32), np.float64)
        return self.logits(ids) / np.float32(temperature) + gumbel


def corrupt(token_ids: list[int], position: int, vocab_size: int) -> list[int]:
    """`token_ids` with one token changed (to one far from it), for checking the checker."""
    out = list(token_ids)
    out[position] = (out[position] + vocab_size // 2) % vocab_size
    return out


def compare_choice(req: SoakRequest, index: int, served: dict, offline, reference: Reference) -> dict | None:
    """None if served choice `index` agrees with the offline output; else what differs.
    'near_tie' entries are accepted differences (greedy_check's rule), all others mismatches."""
    from paged_jax.engine.core_requests import completion_seed
    from tests.helpers.greedy_check import assert_greedy_match

    want, got = list(offline.token_ids), list(served["token_ids"])
    base = {"request": req.index, "choice": index, "endpoint": req.endpoint, "stream": req.stream,
            "sampling": req.sampling, "n": req.n, "stop": req.stop, "prompt_len": len(req.prompt_token_ids),
            "offline": want, "served": got}
    if want == got:
        if served["text"] != offline.text or served["finish_reason"] != offline.finish_reason:
            return {**base, "kind": "text_or_finish_reason", "offline_text": offline.text,
                    "served_text": served["text"], "offline_finish": offline.finish_reason,
                    "served_finish": served["finish_reason"]}
        return None
    prompt = req.prompt_token_ids
    if req.beam:  # no near-tie rule here: a beam's rank rests on sums of logprobs; any difference counts
        return {**base, "kind": "mismatch", "detail": f"beam {index} differs"}
    if req.temperature == 0:
        scores = reference.logits
    else:
        seed = completion_seed(req.seed, index)
        scores = lambda ids: reference.sampling_scores(ids, len(prompt), seed, req.temperature)  # noqa: E731
    try:
        assert_greedy_match(prompt, want, got, scores)
    except AssertionError as exc:
        return {**base, "kind": "mismatch", "detail": str(exc).splitlines()[0]}
    return {**base, "kind": "near_tie"}


REPLAY_KEYS = ("num_steps", "num_preemptions", "prefix_cache_hit_tokens", "prefix_cache_query_tokens")


def check_answers(engine, plan: list[SoakRequest], results: list[SoakResult], wave: int = 64) -> dict:
    """Replay every checkable request on `engine` and compare (see the module docstring)."""
    todo = {str(r.index): (plan[r.index].prompt_token_ids, offline_params(plan[r.index]))
            for r in results if checkable(r)}
    start, before = time.perf_counter(), engine.stats()
    offline = run_requests(engine, todo, wave=wave)
    replay_s, after = time.perf_counter() - start, engine.stats()
    reference = Reference(engine)
    findings, usage_errors, checked = [], [], {"greedy": 0, "seeded": 0, "beam": 0}
    for r in results:
        if not checkable(r):
            continue
        req, out = plan[r.index], offline[str(r.index)]
        if sorted(r.choices) != list(range(req.n)):
            findings.append({"request": r.index, "kind": "choices", "detail": f"choices {sorted(r.choices)}, "
                             f"n={req.n}"})
            continue
        for index, served in r.choices.items():
            checked[req.sampling] += 1
            finding = compare_choice(req, index, served, out.outputs[index], reference)
            if finding is not None:
                findings.append(finding)
        generated = sum(len(c["token_ids"]) for c in r.choices.values())
        if r.usage is not None and (r.usage.get("prompt_tokens") != len(req.prompt_token_ids)
                                    or r.usage.get("completion_tokens") != generated):
            usage_errors.append({"request": r.index, "usage": r.usage, "prompt_tokens": len(req.prompt_token_ids),
                                 "generated": generated})
    mismatches = [f for f in findings if f["kind"] != "near_tie"]
    return {"checked_choices": checked, "mismatches": len(mismatches), "near_ties": len(findings) - len(mismatches),
            "mismatch_examples": mismatches[:10], "near_tie_examples": [f for f in findings
                                                                         if f["kind"] == "near_tie"][:5],
            "usage_disagreements": len(usage_errors), "usage_examples": usage_errors[:5],
            "replay_seconds": round(replay_s, 1),
            "replay_engine": {k: after[k] - before[k] for k in REPLAY_KEYS}}


# ---- /metrics against the client's counts ---------------------------------------------
def scrape(base_url: str) -> dict:
    """{sample name: value} from GET /metrics, labelled samples as name{k=v,...}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base_url + "/metrics", timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _agree(server, client, low=None, high=None) -> dict:
    if low is None:
        return {"server": server, "client": client, "ok": server == client}
    return {"server": server, "client_range": [low, high], "ok": low <= server <= high}


def counter_agreement(metrics: dict, plan: list[SoakRequest], results: list[SoakResult], stats: dict) -> dict:
    """/metrics against what the clients saw. Exact for answered requests; a disconnected
    request counts as aborted (exactly, for a stream left after its first tokens: it was
    certainly running), and its tokens lie between what its client saw and its maximum."""
    answered = [r for r in results if checkable(r)]
    streams_left = [r for r in results if r.disconnected and plan[r.index].disconnect == "stream"]
    gave_up = [r for r in results if r.disconnected and plan[r.index].disconnect == "wait"]
    reasons = {"stop": 0, "length": 0}
    for r in answered:
        for c in r.choices.values():
            reasons[c["finish_reason"]] = reasons.get(c["finish_reason"], 0) + 1
    prompt = sum(len(plan[r.index].prompt_token_ids) for r in answered)
    generated = sum(r.tokens_seen for r in answered)
    left_prompt = sum(len(plan[r.index].prompt_token_ids) for r in streams_left)
    gave_up_prompt = sum(len(plan[r.index].prompt_token_ids) for r in gave_up)
    seen_left = sum(r.tokens_seen for r in streams_left)
    most_left = sum(plan[r.index].max_tokens * plan[r.index].n for r in streams_left + gave_up)
    m = lambda name: metrics.get(name, 0.0)  # noqa: E731
    checks = {f"request_success_{k}": _agree(m(f"paged_jax_request_success_total{{finished_reason={k}}}"), v)
              for k, v in reasons.items()}
    checks["request_aborted"] = _agree(m("paged_jax_request_aborted_total"), len(streams_left),
                                       len(streams_left), len(streams_left) + len(gave_up))
    checks["prompt_tokens"] = _agree(m("paged_jax_prompt_tokens_total"), prompt, prompt + left_prompt,
                                     prompt + left_prompt + gave_up_prompt)
    checks["generation_tokens"] = _agree(m("paged_jax_generation_tokens_total"), generated, generated + seen_left,
                                         generated + most_left)
    rejected = sum(v for k, v in metrics.items() if k.startswith("paged_jax_request_rejected_total"))
    checks["request_rejected"] = _agree(rejected, sum(r.status not in (None, 200) for r in results))
    checks["preemptions"] = _agree(m("paged_jax_num_preemptions_total"), stats.get("num_preemptions"))
    checks["prefix_cache_hits"] = _agree(m("paged_jax_prefix_cache_hits_total"), stats.get("prefix_cache_hit_tokens"))
    pool = [v for k, v in metrics.items() if "pool_check_failures" in k and not k.endswith("_created")]
    if pool or "num_pool_check_failures" in stats:
        checks["pool_check_failures"] = _agree(pool[0] if pool else None, stats.get("num_pool_check_failures"))
    return {"all_agree": all(c["ok"] for c in checks.values()), "checks": checks}


# ---- leaks ----------------------------------------------------------------------------
def _size(obj, *attrs):
    for attr in attrs:
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return len(obj)


def bookkeeping(engine, loop=None) -> dict:
    """Per-request state left in the engine (and the server's engine loop): all 0 when idle.
    Runner rows of sequences that finished in the last step are dropped at the next
    schedule (block_tables.py), so those are not counted."""
    from paged_jax.core.block_manager_invariants import broken_invariants
    core, bm, sched = engine.core, engine.block_manager, engine.scheduler
    finished = set(getattr(sched, "_finished_ids", ()))
    rows = getattr(getattr(engine.runner, "block_tables", None), "_rows", {})
    out = {"core_requests": _size(core, "_requests"), "core_seqs": _size(core, "_seqs"),
           "block_tables": _size(bm, "_tables"), "block_token_counts": _size(bm, "_num_tokens"),
           "block_keys": _size(bm, "_keys"), "block_salts": _size(bm, "_salts"),
           "block_changed": _size(bm, "_changed"), "swapped_seqs": _size(bm, "_swap", "swapped"),
           "runner_rows": len(set(rows) - finished), "front_end_requests": _size(engine.output_processor, "_requests"),
           "running": len(sched.running), "waiting": len(sched.waiting), "swapped": sched.num_swapped,
           "blocks_not_free": bm.num_usable_blocks - bm.num_free_blocks,
           "host_blocks_not_free": bm.num_host_blocks - bm.num_free_host_blocks,
           "broken_invariants": len(broken_invariants(bm))}
    if loop is not None:
        out.update(loop_sinks=len(loop._sinks), loop_output_requests=_size(loop.output_processor, "_requests"))
    return out


def leaks(book: dict) -> dict:
    return {k: v for k, v in book.items() if v}


# ---- RSS ------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class RssSampler:
    """Samples the process's RSS every `interval` seconds, with the count of finished
    requests at that moment (`progress()`), in a daemon thread."""

    def __init__(self, progress, interval: float = 0.5):
        self.samples: list[tuple[float, int, int]] = []  # (seconds, rss bytes, requests done)
        self._progress, self._interval = progress, interval
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._start, rss_bytes(), self._progress()))
            self._stop.wait(self._interval)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic() - self._start, rss_bytes(), self._progress()))
        return self.samples


def rss_drift(samples, total: int, warm_fraction: float = 0.1) -> dict:
    """RSS after the first `warm_fraction` of the requests finished against RSS at the end
    (the last sample), and the peak; drift in percent of the warm value."""
    warm = next((rss for _, rss, done in samples if done >= warm_fraction * total), samples[-1][1])
    end = samples[-1][1]
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    return {"rss_warm_mib": mib(warm), "rss_end_mib": mib(end), "rss_peak_mib": mib(max(s[1] for s in samples)),
            "rss_drift_pct": round(100.0 * (end - warm) / warm, 2), "num_samples": len(samples)}


def counts_by_kind(plan: list[SoakRequest], results: list[SoakResult]) -> dict:
    """Requests by each dimension of the mix, and by outcome."""
    by: dict[str, dict[str, int]] = {}
    for req, r in zip(plan, results):
        outcome = "error" if r.error else "disconnected" if r.disconnected else "answered"
        for group, key in (("endpoint", req.endpoint), ("stream", req.stream), ("sampling", req.sampling),
                           ("n", req.n), ("stop_strings", bool(req.stop)), ("shared_prefix", req.prefix is not None),
                           ("logprobs", req.logprobs is not None), ("best_of", req.best_of),
                           ("prompt_as_ids", isinstance(req.prompt, list)), ("disconnect", req.disconnect),
                           ("outcome", outcome)):
            by.setdefault(group, {}).setdefault(str(key), 0)
            by[group][str(key)] += 1
    return by
