"""Block-map movies: the paper's allocators side by side, filling one KV pool over a trace.

    python -m experiments.block_map_movie                    # paged vs contiguous-max vs contiguous-oracle, ShareGPT-like
    python -m experiments.block_map_movie --kv_allocator=paged,contiguous-pow2 --workload=alpaca --frames=60

Why: PagedAttention's argument is a picture, the paper's Figure 2 and 3: a contiguous
allocator reserves each request's maximum length up front (or, with an oracle, its exact
final length), so most of its address space holds tokens that are not there yet or never
will be, and the free space it leaves is cut into gaps too short for the next request;
paged blocks hold only tokens that exist, and forks or shared prefixes share them. This
replays one trace through each allocator with the engine's own scheduler and allocator
in virtual time (the simulator: experiments/simulator/simulator.py, no model; the
step-time model gives the clock), takes the pool's snapshot after every step
(engine/pool_snapshot.py, as the server's /dashboard does), and draws the snapshots of
all allocators at the same virtual times side by side (experiments/reporting/block_map.py):
blocks by owning request, reservation waste, external fragments, shared and cached blocks.

Writes <--output>.gif (matplotlib's Pillow writer) and <--output>.png, the frame at
--still (a fraction of the trace's duration).
"""

from __future__ import annotations

import bisect
import os

from absl import app, flags


# flags are defined when run as a script only, so that tests can import record_snapshots
def _define_flags() -> None:
    from paged_jax.config.engine_config import KV_ALLOCATORS
    flags.DEFINE_list("kv_allocator", ["paged", "contiguous-max", "contiguous-oracle"],
                      f"Allocators side by side, among {KV_ALLOCATORS}.")
    flags.DEFINE_string("workload", "sharegpt", "Trace (experiments/benchmarks/workloads.py WORKLOADS).")
    flags.DEFINE_integer("num_requests", 150, "Requests in the trace.")
    flags.DEFINE_float("request_rate", 3.0, "Poisson arrivals per second of virtual time.")
    flags.DEFINE_integer("num_blocks", 577, "KV blocks incl. the null block (small, so the map is legible).")
    flags.DEFINE_integer("block_size", 16, "Tokens per block.")
    flags.DEFINE_integer("max_model_len", 2048, "Engine max_model_len (contiguous-max reserves it).")
    flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step.")
    flags.DEFINE_integer("frames", 120, "Frames in the movie (evenly spaced in virtual time).")
    flags.DEFINE_integer("fps", 8, "Frames per second of the GIF.")
    flags.DEFINE_float("still", 0.35, "Where the PNG still is taken, as a fraction of the duration.")
    flags.DEFINE_string("step_time_model", "experiments/results/step_time_model.json",
                        "Step-time model (calibrate_step_time.py's record) for the virtual clock.")
    flags.DEFINE_string("model_config", "smollm2_135m", "configs preset: vocabulary and KV layout.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_string("output", "experiments/plots/block_map_movie", "Output path without extension.")


def record_snapshots(trace, config, step_model, model_config) -> list[dict]:
    """Every step's snapshot of one allocator serving `trace` in virtual time."""
    from experiments.simulator.simulator import simulated_serving
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.engine.pool_snapshot import take_snapshot
    make_engine, clock, _ = simulated_serving(model_config, step_model)
    engine = make_engine(config)
    snapshots, next_index = [take_snapshot(engine.core, clock=clock)], 0
    while next_index < len(trace) or engine.has_unfinished_requests():
        while next_index < len(trace) and trace[next_index].arrival_time <= clock.now:
            request = trace[next_index]
            engine.add_request(f"r{next_index}", {"prompt_token_ids": request.prompt_token_ids},
                               SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0),
                               arrival_time=request.arrival_time)
            next_index += 1
        if not engine.has_unfinished_requests():
            clock.now = trace[next_index].arrival_time
        else:
            engine.step()
        snapshots.append(take_snapshot(engine.core, clock=clock))
    return snapshots


def at(snapshots: list[dict], times: list[float], t: float) -> dict:
    """The snapshot in force at virtual time t (the last one taken at or before it)."""
    return snapshots[max(0, bisect.bisect_right(times, t) - 1)]


def main(argv):
    del argv
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation, PillowWriter
    from tqdm.auto import tqdm

    import configs
    from experiments.benchmarks.workloads import make_trace
    f = flags.FLAGS
    from experiments.reporting.block_map import add_legend, block_map_image, caption, grid_columns
    from experiments.simulator.step_time_model import StepTimeModel
    from paged_jax.config.engine_config import EngineConfig

    model_config = configs.get_config(f.model_config)
    step_model = StepTimeModel.load(f.step_time_model)
    trace = make_trace(f.workload, f.num_requests, seed=f.seed, max_model_len=f.max_model_len,
                       vocab_size=model_config.vocab_size, request_rate=f.request_rate)
    runs = {}
    for allocator in f.kv_allocator:
        config = EngineConfig(block_size=f.block_size, num_blocks=f.num_blocks,
                              max_model_len=f.max_model_len, max_num_seqs=f.max_num_seqs,
                              max_num_batched_tokens=256, kv_allocator=allocator, enable_prefix_caching=False,
                              attention_backend="reference")  # unused: no model runs
        snapshots = record_snapshots(trace, config, step_model, model_config)
        runs[allocator] = (snapshots, [s["time"] for s in snapshots])
        print(f"{allocator}: {len(snapshots) - 1} steps, {snapshots[-1]['time']:.1f} s of virtual time")
    duration = max(times[-1] for _, times in runs.values())
    frame_times = [duration * k / (f.frames - 1) for k in range(f.frames)]
    columns = grid_columns(f.num_blocks, aspect=1.6)
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.9), squeeze=False)
    images = []
    for ax, (allocator, (snapshots, times)) in zip(axes[0], runs.items()):
        images.append(ax.imshow(block_map_image(snapshots[0], columns), interpolation="nearest"))
        ax.set_xticks([])
        ax.set_yticks([])
    title = fig.suptitle("")
    add_legend(fig)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.86, bottom=0.1, wspace=0.04)

    def draw(t: float) -> None:
        for ax, image, (allocator, (snapshots, times)) in zip(axes[0], images, runs.items()):
            snap = at(snapshots, times, t)
            image.set_data(block_map_image(snap, columns))
            ax.set_title(f"{allocator}\n{caption(snap)}", fontsize=7)
        title.set_text(f"{f.workload}-like trace, {f.num_requests} requests at {f.request_rate}/s, "
                       f"{f.num_blocks - 1} blocks of {f.block_size}: t = {t:5.1f} s (virtual)")

    os.makedirs(os.path.dirname(f.output) or ".", exist_ok=True)
    draw(duration * f.still)
    fig.savefig(f.output + ".png", dpi=110)
    bar = tqdm(total=len(frame_times), desc="frames")

    def frame(k: int):
        draw(frame_times[k])
        bar.update(1)
        return images

    FuncAnimation(fig, frame, frames=len(frame_times)).save(f.output + ".gif", writer=PillowWriter(fps=f.fps),
                                                             dpi=80)
    bar.close()
    for ext in (".png", ".gif"):
        print(f"wrote {f.output}{ext} ({os.path.getsize(f.output + ext) / 1e6:.2f} MB)")


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
