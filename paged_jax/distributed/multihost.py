"""Multi-host serving: one tensor-parallel mesh over the devices of several processes.

JAX is multi-controller: every process must call the same jitted step with the same
inputs, and each drives only its own devices. paged_jax keeps one scheduler and one
block manager, on process 0 (the leader); before each step the leader broadcasts the
step's padded inputs (`BatchInputs`, a few small int/float arrays) to the other
processes (followers), which run the same step on their shards and discard its
(replicated) results. Every process builds the same `LLMEngine` (same model, same
flags: same resolved config, same buckets, same warm-up), so only the leader's
scheduler ever schedules; the followers' stay empty.

Start (the same command on every host, only --process_id differs; on CPU add
--num_cpu_devices=N to give each process N devices):

    python -m experiments.serve_local --tensor_parallel_size=8 \
        --coordinator_address=HOST0:1234 --num_processes=2 --process_id=0   # on host 0
    ...                                                 --process_id=1   # on host 1

Limits, each refused with a clear error: the mesh spans all devices of all processes
(tensor_parallel_size == jax.device_count()), and preemption is by recompute (a swap
would move KV blocks through one process's host memory, but each process holds only
its own heads of every block). If the leader dies mid-step the followers wait forever
in the next broadcast: supervise the processes as one job.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils


OP_STOP, OP_STEP, OP_WARM_UP = 0, 1, 2  # header[0]: what the followers do next


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = None  # "host:port" of process 0; None: single process
    num_processes: int = 1  # processes in the job, one per host (or several per host on CPU)
    process_id: int = 0  # this process, 0 = the leader that schedules
    num_cpu_devices: int | None = None  # CPU only: devices this process exposes (jax_num_cpu_devices)
    cpu_collectives: str = "gloo"  # CPU only: cross-process collectives (jax_cpu_collectives_implementation)

    def __post_init__(self):
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {self.num_processes!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(f"num_processes={self.num_processes} needs --coordinator_address=HOST:PORT "
                             "(process 0's address, the same on every process)")
        if self.num_cpu_devices is not None and self.num_cpu_devices < 1:
            raise ValueError(f"num_cpu_devices must be >= 1, got {self.num_cpu_devices}")


def define_flags(flag_values=flags.FLAGS) -> None:
    """The DistributedConfig fields as absl flags (for entry points such as serve_local)."""
    flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0, the same on every "
                        "process; unset = one process.", flag_values=flag_values)
    flags.DEFINE_integer("num_processes", 1, "Multi-host: number of processes in the job.", flag_values=flag_values)
    flags.DEFINE_integer("process_id", 0, "Multi-host: this process's index; 0 schedules and serves, the others "
                         "follow its steps.", flag_values=flag_values)
    flags.DEFINE_integer("num_cpu_devices", None, "CPU only: number of devices this process exposes (e.g. to "
                         "test tensor parallelism on one machine).", flag_values=flag_values)
    flags.DEFINE_string("cpu_collectives", "gloo", "CPU only: cross-process collectives implementation.",
                        flag_values=flag_values)


def config_from_flags(flag_values=flags.FLAGS) -> DistributedConfig:
    return DistributedConfig(**{f.name: flag_values[f.name].value for f in dataclasses.fields(DistributedConfig)})


def initialize(config: DistributedConfig) -> None:
    """Set up JAX for this process: must run before anything touches a JAX device."""
    if config.num_cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", config.num_cpu_devices)
    if config.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)  # ignored off CPU
        jax.distributed.initialize(config.coordinator_address, num_processes=config.num_processes,
                                   process_id=config.process_id)


def check_engine(engine) -> None:
    """What a multi-process engine must satisfy (see the module doc)."""
    if jax.process_count() == 1:
        return
    if engine.runner.mesh is None:  # tensor_parallel.make_mesh checks the mesh spans every device
        raise ValueError(f"{jax.process_count()} processes need tensor_parallel_size={jax.device_count()}")
    # swap (preemption_mode="swap") is refused by the runner itself, before its warm-up


class StepBroadcaster:
    """The leader's side: sends each step's inputs before the runner runs it."""

    def __init__(self, runner):
        self.runner = runner
        self.num_steps = 0

    def attach(self) -> None:
        """Compile the broadcasts of every bucket now (followers receive them too), then
        hook every later step."""
        for num_seqs, num_tokens in self.runner.batch_shapes():
            _broadcast_header(OP_WARM_UP, num_seqs, num_tokens)
            multihost_utils.broadcast_one_to_all(self.runner.empty_batch(num_seqs, num_tokens))
        self.runner.on_step = self.send

    def send(self, batch) -> None:
        num_seqs, num_tokens = batch.context_lens.shape[0], batch.token_ids.shape[0]
        _broadcast_header(OP_STEP, num_seqs, num_tokens)
        multihost_utils.broadcast_one_to_all(batch)
        self.num_steps += 1

    def stop(self) -> None:
        """Release the followers (their `follow` returns)."""
        self.runner.on_step = None
        _broadcast_header(OP_STOP, 0, 0)


def follow(runner) -> int:
    """A follower's loop: receive each step's inputs from the leader and run the same
    step on this process's shards, until the leader stops. Returns the steps run."""
    steps = 0
    while True:
        op, num_seqs, num_tokens = (int(x) for x in _broadcast_header(OP_STOP, 0, 0, is_source=False))
        if op == OP_STOP:
            return steps
        template = runner.empty_batch(num_seqs, num_tokens)  # the shapes a broadcast needs on every side
        batch = multihost_utils.broadcast_one_to_all(template, is_source=False)
        if op == OP_STEP:
            runner.run_batch(type(template)(*batch))
            steps += 1


def run(engine, leader_fn):
    """Run `leader_fn()` (serve, generate, ...) on process 0 with every step broadcast,
    while the other processes follow; single-process: just `leader_fn()`. Returns
    leader_fn's result on the leader, the number of steps followed elsewhere."""
    check_engine(engine)
    if jax.process_count() == 1:
        return leader_fn()
    if jax.process_index() != 0:
        return follow(engine.runner)
    broadcaster = StepBroadcaster(engine.runner)
    broadcaster.attach()
    try:
        return leader_fn()
    finally:
        broadcaster.stop()


def _broadcast_header(op: int, num_seqs: int, num_tokens: int, *, is_source: bool | None = None) -> np.ndarray:
    return multihost_utils.broadcast_one_to_all(np.array([op, num_seqs, num_tokens], np.int32), is_source=is_source)

