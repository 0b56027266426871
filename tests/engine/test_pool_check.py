"""The KV pool's self-check (engine/pool_check.py): silent on a healthy engine under every
kind of traffic, loud (error log, stats counter, metric) on a leaked block, table or request,
and the engine keeps serving after reporting.

The leaks are injected the way a bug would make them: `BlockManager.free` that keeps one
reference of the first sequence it frees (a block no table holds that never returns to the
free queue), and `EngineCore._drop` that forgets to drop a finished request. The engine runs
on the model-free runner, which also checks every K/V read (tests/helpers/model_free_runner.py).
"""

import logging

import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.block_manager import BlockManager
from paged_jax.engine.engine_core import EngineCore
from paged_jax.entrypoints.openai.metrics import ServerMetrics
from tests.helpers.model_free_runner import Req, greedy, make_engine, serve

# 40 usable blocks of 4 tokens: the traffic below preempts (recompute or swap) and evicts cached prefixes
TIGHT = dict(block_size=4, num_blocks=41, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
             swap_space_bytes=2**20)
SHARED = tuple(range(100, 124))  # a 24-token system prompt: 6 full blocks shared through the prefix cache


def _traffic() -> list[Req]:
    reqs = []
    for i in range(24):
        prompt = SHARED + tuple(200 + (i * 7 + j) % 50 for j in range(3 + i % 9)) if i % 2 else \
            tuple(150 + (i * 11 + j) % 40 for j in range(5 + i % 13))
        params = BeamSearchParams(beam_width=2, max_tokens=6) if i % 7 == 3 else greedy(4 + i % 17, n=1 + (i % 5 == 0))
        reqs.append(Req(prompt, params, arrival_step=i // 3))
    return reqs


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_healthy_engine_passes_every_check(preemption_mode, caplog):
    config = EngineConfig(**TIGHT, preemption_mode=preemption_mode, pool_check="step")
    finished, refused, engine = serve(config, _traffic())
    stats = engine.stats()
    assert len(finished) == 24 and not refused
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0  # the traffic is not trivial
    assert engine.core.pool_checker.num_checks >= stats["num_steps"]  # it ran after every step
    assert stats["num_pool_check_failures"] == 0, engine.core.pool_checker.last_problems
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_aborts_and_stop_strings_leave_nothing_behind():
    engine = make_engine(EngineConfig(**TIGHT, pool_check="step"))
    engine.add_request("a", {"prompt_token_ids": list(SHARED)}, greedy(20, n=3))
    engine.add_request("b", {"prompt_token_ids": list(SHARED[:9])}, greedy(30))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    engine.core.finish_sequence("b", 0, "stop")  # what the front end does on a stop string
    assert not engine.has_unfinished_requests()
    assert engine.core.pool_checker.num_checks >= 6
    assert engine.stats()["num_pool_check_failures"] == 0


def _leak_one_block(monkeypatch):
    """BlockManager.free keeps one extra reference to the first table's first block, once."""
    original, leaked = BlockManager.free, []

    def free(self, seq_id):
        if not leaked:
            block = self._tables[seq_id][0]
            (self._swap.pool if seq_id in self._swap.swapped else self._device).incr_ref([block])
            leaked.append(block.block_id)
        original(self, seq_id)

    monkeypatch.setattr(BlockManager, "free", free)
    return leaked


@pytest.mark.parametrize("mode", ["idle", "step"])
def test_a_leaked_block_is_reported_and_the_engine_keeps_serving(monkeypatch, caplog, mode):
    leaked = _leak_one_block(monkeypatch)
    engine = make_engine(EngineConfig(**TIGHT, pool_check=mode))
    engine.add_request("a", {"prompt_token_ids": list(range(10, 19))}, greedy(3))
    engine.add_request("b", {"prompt_token_ids": list(range(20, 29))}, greedy(8))
    failures_while_b_runs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a" and out.finished:  # a's blocks freed (one leaked) while b still runs
                failures_while_b_runs = engine.stats()["num_pool_check_failures"]
    assert leaked and failures_while_b_runs is not None
    # "step" walks ref counts at once; "idle" only counts, when nothing runs any more
    assert failures_while_b_runs == (1 if mode == "step" else 0)
    checker = engine.core.pool_checker
    assert engine.stats()["num_pool_check_failures"] >= 1
    assert any("1 of 40 usable device blocks are not free" in p for p in checker.last_problems), checker.last_problems
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "KV pool self-check failed" in errors[-1] and "leaked blocks" in errors[-1]
    # reported, not fatal: the engine still serves
    engine.add_request("c", {"prompt_token_ids": list(range(30, 39))}, greedy(4))
    outs = [o for _ in range(20) if engine.has_unfinished_requests() for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outs] == [4]


def test_step_mode_names_the_block_whose_ref_count_no_table_explains(monkeypatch):
    leaked = _leak_one_block(monkeypatch)
    engine = make_engine(EngineConfig(**TIGHT, pool_check="step"))
    engine.add_request("a", {"prompt_token_ids": list(range(10, 19))}, greedy(2))
    engine.add_request("b", {"prompt_token_ids": list(range(20, 29))}, greedy(9))
    while engine.stats()["num_pool_check_failures"] == 0:
        engine.step()
    assert engine.has_unfinished_requests()  # found while b still runs
    assert any(f"device block {leaked[0]}: ref_count 1 but 0 tables hold it" in p
               for p in engine.core.pool_checker.last_problems)


def test_a_leaked_request_is_reported(monkeypatch):
    monkeypatch.setattr(EngineCore, "_drop", lambda self, request: None)  # forgets finished requests
    engine = make_engine(EngineConfig(**TIGHT))  # the default mode: "idle"
    engine.add_request("a", {"prompt_token_ids": list(range(10, 19))}, greedy(3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_pool_check_failures"] == 1
    assert any("the engine still holds 1 requests" in p for p in engine.core.pool_checker.last_problems)


def test_off_checks_nothing(monkeypatch):
    _leak_one_block(monkeypatch)
    engine = make_engine(EngineConfig(**TIGHT, pool_check="off"))
    engine.add_request("a", {"prompt_token_ids": list(range(10, 19))}, greedy(3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.block_manager.num_free_blocks == 39  # the leak is there, unreported
    assert engine.stats()["num_pool_check_failures"] == 0 and engine.core.pool_checker.num_checks == 0


def test_the_metric_reads_the_stats():
    text = ServerMetrics(lambda: {"num_pool_check_failures": 3}).render().decode()
    assert "paged_jax_kv_pool_check_failures_total 3.0" in text


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="pool_check must be one of"):
        EngineConfig(pool_check="sometimes")
