"""A tiny soak through experiments/benchmarks/soak_run.py, the code of `python -m experiments.soak`.

Two phases of a few dozen requests in all (recompute, then swap preemption) on a KV cache
so small that sequences are preempted, against a live server on loopback: every kind of
traffic (completions and chat, streamed and not, greedy, seeded and beams, n > 1, stop strings,
shared prefixes, a client that disconnects mid-stream). Every answer must equal the
offline engine's, nothing may leak, and /metrics must agree with the clients. And the
checker itself must be able to fail: one changed token is a mismatch, not a near-tie.
"""

import pytest

from experiments.benchmarks import soak_checks
from experiments.benchmarks.soak_run import engine_config, run_phase
from experiments.benchmarks.soak_traffic import make_plan

# small buckets and layer_loop "scan" (fast compiles, as tests/helpers/server_harness.py);
# 20 blocks of 16 tokens: a few requests fill them, so sequences are preempted
SETTINGS = dict(block_size=16, num_blocks=20, max_model_len=160, max_num_seqs=16, max_num_batched_tokens=128,
                seq_buckets=(4, 16), token_buckets=(16, 64, 128), layer_loop="scan", pool_check="step")
PLAN = dict(rate=0, min_tokens=6, max_tokens=14, num_prefixes=2, prefix_words=30, disconnect_fraction=0.12,
            max_n=2, max_model_len=160, long_words=(30, 60), beam_fraction=0.15)
PER_PHASE = 16

# two phases against a live server (~1 min on 2 cores): CI's `-m slow` run; the server's
# own tests check each kind of traffic in the default run
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak():
    from paged_jax.loading import load_model
    loaded = load_model("smollm2-135m")
    phases = {}
    for i, mode in enumerate(("recompute", "swap")):
        plan = make_plan(PER_PHASE, tokenizer=loaded.tokenizer, seed=i, **PLAN)
        phases[mode] = (plan, run_phase(loaded, engine_config(**SETTINGS, preemption_mode=mode), plan,
                                        max_concurrency=24, show_progress=False))
    return phases


def test_the_plan_has_every_kind_of_traffic(soak):
    plans = [plan for plan, _ in soak.values()]
    reqs = [r for plan in plans for r in plan]
    assert {r.endpoint for r in reqs} == {"completions", "chat"}
    assert {r.stream for r in reqs} == {True, False}
    assert {r.sampling for r in reqs} == {"greedy", "seeded", "beam"}
    assert any(r.n > 1 for r in reqs) and any(r.stop for r in reqs) and any(r.prefix is not None for r in reqs)
    assert any(isinstance(r.prompt, list) for r in reqs) and any(r.logprobs is not None for r in reqs)
    for plan in plans:  # each phase has a client that leaves mid-stream
        assert any(r.disconnect == "stream" for r in plan)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tiny_soak_is_clean(soak, mode):
    _, phase = soak[mode]
    f = phase.figures
    assert f["preemption_mode"] == mode
    assert f["errors"] == 0, f["error_examples"]
    assert f["mismatches"] == 0, f["mismatch_examples"]
    assert f["checked_choices"]["greedy"] and f["checked_choices"]["seeded"]
    assert sum(soak[m][1].figures["checked_choices"]["beam"] for m in soak)  # beams answered in one phase at least
    assert f["usage_disagreements"] == 0, f["usage_examples"]
    assert f["num_leaks"] == 0, (f["leaks"], f["leaks_after_replay"])
    assert not f["hang"] and f["server_stopped_cleanly"]
    assert f["pool_check_failures"] == 0 and f["pool_checks_run"] >= f["engine_stats"]["num_steps"]
    assert f["pool_check_failures_with_replay"] == 0
    assert f["preemptions"] > 0, "the KV budget must force preemption"
    assert (f["swapped_out_seqs"] > 0) == (mode == "swap")
    assert f["disconnects"] >= 1 and f["counters"]["checks"]["request_aborted"]["server"] >= 1
    assert f["counters"]["all_agree"], f["counters"]
    assert f["engine_stats"]["num_blocks_used"] == 0
    assert f["rss"]["num_samples"] >= 2


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "beam"])
def test_a_changed_token_is_a_mismatch(soak, sampling):
    """The checker can fail: the served answer with one token changed is reported."""
    plan, phase = soak["swap"]
    engine = phase.engine
    reference = soak_checks.Reference(engine)
    result = next(r for r in phase.results if soak_checks.checkable(r) and plan[r.index].sampling == sampling
                  and len(r.choices[0]["token_ids"]) >= 3)
    req = plan[result.index]
    [offline] = soak_checks.run_requests(engine, {"x": (req.prompt_token_ids, soak_checks.offline_params(req))}
                                         ).values()
    served = dict(result.choices[0])
    assert soak_checks.compare_choice(req, 0, served, offline.outputs[0], reference) is None
    served["token_ids"] = soak_checks.corrupt(served["token_ids"], 1, engine.model_config.vocab_size)
    finding = soak_checks.compare_choice(req, 0, served, offline.outputs[0], reference)
    assert finding is not None and finding["kind"] == "mismatch", finding
    assert ("beam 0 differs" if sampling == "beam" else "differ at generated token 1") in finding["detail"]
