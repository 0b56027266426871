"""Progress: every request the engine's admission checks accept must finish.

The engine refuses, at add_request, what could never fit (a request whose sequences
cannot all be held at once with nothing shared; a prompt at max_model_len). Everything
it accepts must then finish, under every preemption mode and allocator, whatever else
is queued: a step that schedules nothing while work remains is a RuntimeError ("the
scheduler cannot make progress"), and a schedule that keeps preempting without end
trips the step limit. The runner (tests/helpers/model_free_runner.py) also checks every
K/V read, so swaps, copy-on-write and prefix-cache hits must hand each sequence its own
prefix. First the issue's repro and hand cases at the edge, then an exhaustive grid of
two-request cases, then a random sweep over small pools, block sizes, watermarks,
budgets, lengths, n, beams, arrivals, modes, swap space and allocators.
"""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.worker.kv_cache import bytes_per_block
from tests.helpers.model_free_runner import MODEL_CONFIG, Req, greedy, serve


def _config(**kw) -> EngineConfig:
    kw.setdefault("attention_backend", "reference")  # resolved without asking jax for a platform
    if "swap_blocks" in kw:  # host swap space in blocks rather than bytes
        kw["swap_space_bytes"] = kw.pop("swap_blocks") * bytes_per_block(MODEL_CONFIG, kw["block_size"], "float32")
    return EngineConfig(**kw)


def _expected_len(config, req) -> int:
    return min(req.params.max_tokens, config.max_model_len - len(req.prompt))


def _check_all_finished(config, requests, finished, refused):
    assert set(finished) | refused == {str(i) for i in range(len(requests))}
    for rid, out in finished.items():
        req = requests[int(rid)]
        want = req.params.beam_width if isinstance(req.params, BeamSearchParams) else req.params.n
        assert len(out.outputs) == want, rid
        for completion in out.outputs:  # ignore_eos: every completion runs to its length limit
            assert len(completion.token_ids) == _expected_len(config, req), (rid, completion)


def _invariants(engine):
    engine.block_manager.check_invariants()


def test_swap_group_needing_exactly_the_free_pool_comes_back():
    """The issue's repro: 2 usable blocks of 8, two requests of 7 + 9 tokens. One is
    swapped out when both need a second block; once the other finishes, it needs both
    blocks (16 tokens) and nothing is shared, but a copy-on-write block was charged per
    sequence anyway: 2 + 1 > 2 free, it never came back, and admissions waited behind it."""
    config = _config(block_size=8, num_blocks=3, max_model_len=16, preemption_mode="swap", watermark=0.0)
    requests = [Req((5,) * 7, greedy(9)), Req((6,) * 7, greedy(9))]
    finished, refused, engine = serve(config, requests, check=_invariants)
    assert not refused
    _check_all_finished(config, requests, finished, refused)
    assert engine.stats()["num_preemptions"] >= 1  # the swap path was taken


def test_swapped_forks_sharing_a_partial_block_are_charged_one_copy_per_writer_but_one():
    """3 usable blocks of 3. The n = 3 request forks once the first of its 2 prompt
    tokens is computed (the completions share that partly full block); the other request
    then takes the last free block, so the three are swapped out as one group sharing one
    block. Back, they take it plus 2 copies (the last writer keeps it): exactly the free
    pool. Charging a copy for each of the 3 left them swapped forever."""
    config = _config(block_size=3, num_blocks=4, max_model_len=9, preemption_mode="swap", watermark=0.0,
                     swap_blocks=16)
    requests = [Req((5,) * 3, greedy(2)), Req((7,) * 2, greedy(1, n=3))]
    finished, refused, engine = serve(config, requests, check=_invariants)
    assert not refused
    _check_all_finished(config, requests, finished, refused)
    assert engine.stats()["num_preemptions"] == 3  # the three completions, swapped as one group


def test_group_swapped_at_its_fork_point_forks_when_it_returns():
    """The n = 2 request is swapped out right after computing all its prompt tokens but
    the last, before it forked: nothing to compute until it forks. Swapped back, it must
    fork at once, or that step schedules nothing and the engine stops."""
    config = _config(block_size=2, num_blocks=5, max_model_len=8, preemption_mode="swap", watermark=0.0,
                     swap_blocks=16)
    requests = [Req((5,) * 5, greedy(3)), Req((7,) * 2, greedy(1, n=2), arrival_step=1)]
    finished, refused, engine = serve(config, requests, check=_invariants)
    assert not refused
    _check_all_finished(config, requests, finished, refused)
    assert engine.stats()["num_preemptions"] == 1


GRID = itertools.product(["recompute", "swap"], [False, True], [2, 3], [4, 5], [1, 2, 4], [1, 3], [1, 3, 5], [2, 8],
                         [0, 1], [1, 2, 3])


def test_a_step_that_preempts_its_only_schedulable_sequence_still_admits():
    """Found by the random sweep: one beam's sequence needs a block, the swap space is
    full, so it is preempted for recompute, and the other beam has nothing to compute
    (it awaits its siblings' candidates). A step that preempted used to admit nothing
    else, so it scheduled nothing at all: "the scheduler cannot make progress"."""
    config = _config(block_size=3, num_blocks=7, max_model_len=9, watermark=0.0, max_num_seqs=4,
                     max_num_batched_tokens=9, enable_chunked_prefill=False, preemption_mode="swap",
                     enable_prefix_caching=False, kv_allocator="paged", swap_blocks=1)
    beams = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    requests = [Req((3,), greedy(8, n=2), arrival_step=3), Req((3,), greedy(8), arrival_step=3),
                Req((3,), greedy(8), arrival_step=3), Req((3,), beams, arrival_step=1),
                Req((3,), greedy(8), arrival_step=3), Req((3,), greedy(8), arrival_step=0)]
    finished, refused, engine = serve(config, requests, max_steps=5000, check=_invariants)
    assert not refused
    _check_all_finished(config, requests, finished, refused)
    assert engine.stats()["num_preemptions"] >= 1


def test_a_request_s_sequences_are_never_preempted_apart():
    """Found by the random sweep: three beams need a block each, one is free; the last
    request's sequences were preempted (swapped) first, then the last beam alone, so its
    two siblings kept their blocks waiting for its candidates while it waited behind an
    earlier swapped group that could not fit: "the scheduler cannot make progress". A
    request's sequences now grow together or are preempted together."""
    config = _config(block_size=2, num_blocks=7, max_model_len=4, watermark=0.0, max_num_seqs=4,
                     max_num_batched_tokens=4, enable_chunked_prefill=False, preemption_mode="swap",
                     enable_prefix_caching=False, kv_allocator="paged", swap_blocks=6)
    requests = [Req((3,), greedy(3)), Req((3,), BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True)),
                Req((3,), greedy(3, n=3))]
    split = []

    def check(engine):
        _invariants(engine)
        running = {s.request_id for s in engine.scheduler.running}
        split.extend(s.request_id for group in engine.scheduler.swapped for s in group if s.request_id in running)

    finished, refused, engine = serve(config, requests, max_steps=5000, check=check)
    _check_all_finished(config, requests, finished, refused)
    assert engine.stats()["num_preemptions"] >= 1
    assert not split, f"requests {sorted(set(split))} were both running and swapped"


def test_two_request_grid_finishes():
    """Every small case of one request behind another (n = 1..3 completions, arriving
    with it or a step later), at watermark 0 where a request may need the whole pool:
    exhaustive, so edge cases a random sweep rarely draws are always run (a group swapped
    out at its fork point, with nothing to compute until it forks, was one)."""
    failures = []
    for mode, caching, block_size, num_blocks, len_a, max_a, len_b, max_b, arrival, n in GRID:
        max_model_len = (num_blocks - 1) * block_size
        if max(len_a, len_b) >= max_model_len:
            continue
        config = _config(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                         preemption_mode=mode, enable_prefix_caching=caching, watermark=0.0, swap_blocks=16)
        max_a, max_b = min(max_a, max_model_len - len_a), min(max_b, max_model_len - len_b)  # else refused
        requests = [Req((5,) * len_b, greedy(max_b)), Req((7,) * len_a, greedy(max_a, n=n), arrival_step=arrival)]
        try:
            finished, refused, _ = serve(config, requests, max_steps=500, check=_invariants)
            _check_all_finished(config, requests, finished, refused)
        except (AssertionError, RuntimeError) as exc:
            failures.append(f"{config_summary(config)} requests {requests}: {type(exc).__name__}: {str(exc)[:120]}")
    assert not failures, f"{len(failures)} cases failed, e.g.\n" + "\n".join(failures[:5])


def config_summary(config) -> str:
    return (f"block_size={config.block_size} num_blocks={config.num_blocks} max_model_len={config.max_model_len} "
            f"{config.preemption_mode} prefix_caching={config.enable_prefix_caching}")


def test_whole_prefill_needs_a_budget_of_max_model_len():
    """Without chunked prefill a prompt longer than the token budget was accepted and then
    never scheduled ("cannot make progress"); the engine now refuses the config."""
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_model_len"):
        serve(_config(block_size=4, num_blocks=9, max_model_len=32, enable_chunked_prefill=False,
                      max_num_batched_tokens=8, max_num_seqs=2), [Req((3,) * 12, greedy(4))])
    config = _config(block_size=4, num_blocks=9, max_model_len=8, enable_chunked_prefill=False,
                     max_num_batched_tokens=8, max_num_seqs=2)
    finished, refused, _ = serve(config, [Req((3,) * 7, greedy(1))])
    assert not refused and len(finished["0"].outputs[0].token_ids) == 1


ALLOCATORS = ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]


@st.composite
def _scenario(draw, allocators=ALLOCATORS):
    allocator = draw(st.sampled_from(allocators))
    paged = allocator == "paged"
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    num_blocks = draw(st.integers(2 if block_size > 1 else 3, 10))  # room for a 2-token max_model_len
    usable = num_blocks - 1
    watermark = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])) if paged else 0.0
    room = usable - int(watermark * usable)
    if room < 1:
        watermark, room = 0.0, usable
    cap = room * block_size
    max_model_len = draw(st.one_of(st.integers(max(2, cap // 2), cap), st.integers(2, cap)))
    max_num_seqs = draw(st.sampled_from([1, 2, 3, 4, 4]))
    chunked = draw(st.booleans())
    min_budget = max(max_num_seqs, max_model_len if not chunked else 1)  # else refused: see the whole-prefill test
    budget = draw(st.integers(min_budget, max(min_budget, 24)))
    config = dict(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, watermark=watermark,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                  kv_allocator=allocator)
    if paged:
        config["preemption_mode"] = draw(st.sampled_from(["recompute", "swap", "swap"]))
        config["enable_prefix_caching"] = draw(st.booleans())
        config["swap_blocks"] = draw(st.sampled_from([0, 1, usable, 2 * usable, 4 * usable]))
    requests = []
    for _ in range(draw(st.sampled_from([1, 2, 3, 4, 6]))):
        base = requests[draw(st.integers(0, len(requests) - 1))].prompt if requests and draw(st.booleans()) else ()
        length = draw(st.one_of(st.integers(1, min(3, max_model_len - 1)), st.integers(1, max_model_len - 1)))
        tail = draw(st.lists(st.integers(3, 6), min_size=length, max_size=length))
        prompt = (tuple(base) + tuple(tail))[:length]
        room = max_model_len - length  # prompt + max_tokens > max_model_len is refused (processor.validate_max_tokens)
        max_tokens = draw(st.one_of(st.just(room), st.integers(1, room)))  # often the longest
        kind = draw(st.sampled_from(["n1", "n", "beam"])) if paged else "n1"
        if kind == "beam":
            params = BeamSearchParams(beam_width=draw(st.integers(1, 3)), max_tokens=max_tokens, ignore_eos=True)
        else:
            params = greedy(max_tokens, n=draw(st.integers(2, 3)) if kind == "n" else 1)
        requests.append(Req(prompt, params, arrival_step=draw(st.sampled_from([0, 0, 1, 3, 8]))))
    return config, requests


SWEEP = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@settings(max_examples=400, **SWEEP)
@given(_scenario(allocators=["paged"]))
def test_every_accepted_request_finishes_paged(scenario):
    _serve_and_check(*scenario)


@settings(max_examples=100, **SWEEP)
@given(_scenario(allocators=ALLOCATORS[1:]))
def test_every_accepted_request_finishes_contiguous(scenario):
    _serve_and_check(*scenario)


def _serve_and_check(config_kw, requests):
    config = _config(**config_kw)
    finished, refused, engine = serve(config, requests, max_steps=5_000, check=_invariants)
    _check_all_finished(config, requests, finished, refused)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks  # nothing leaked
