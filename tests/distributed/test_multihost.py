"""Multi-host tensor parallelism, on one machine: 2 processes x 2 CPU devices form one
4-device mesh (jax.distributed + gloo collectives); process 0 schedules and broadcasts
each step's inputs, process 1 follows. Its greedy output must equal a single process at
tensor_parallel_size=1, token for token (near-ties aside, tests/helpers/greedy_check.py).

Run as a script, this file is the per-process worker (`python tests/distributed/test_multihost.py
--process_id=... --coordinator_address=... --out=...`), driven by paged_jax.distributed.multihost's
own flags.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from tests.helpers.greedy_check import assert_greedy_match

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              seq_buckets=(4,), token_buckets=(4, 32))
MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(1, 40, size=6)]


def _tiny_model():
    import jax

    import configs
    from paged_jax.loading import LoadedModel
    from paged_jax.model.llama import init_params
    cfg = configs.get_config("tiny_llama_tp4")
    return LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, "memory", "memory", 0.0)


def _generate(llm) -> list[list[int]]:
    from paged_jax import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- unit checks (this process, one device) ------------------------------------------------
def test_distributed_config_from_flags():
    from absl import flags

    from paged_jax.distributed.multihost import DistributedConfig, config_from_flags, define_flags
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["prog", "--coordinator_address=10.0.0.1:1234", "--num_processes=2", "--process_id=1",
        "--num_cpu_devices=2"])
    assert config_from_flags(fv) == DistributedConfig("10.0.0.1:1234", 2, 1, 2, "gloo")
    for name in ("coordinator_address", "num_processes", "process_id", "num_cpu_devices", "cpu_collectives"):
        assert fv[name].help, name


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_processes=2), "needs --coordinator_address"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"process_id must be in \[0, 2\)"),
    (dict(num_processes=0), "num_processes must be an int >= 1"),
    (dict(num_cpu_devices=0), "num_cpu_devices must be >= 1"),
])
def test_distributed_config_refuses_bad_values(kwargs, message):
    from paged_jax.distributed.multihost import DistributedConfig
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs)


def test_single_process_run_steps_without_broadcasting(tiny_llama):
    """One process: `run` just runs the leader function; the runner has no step hook."""
    from paged_jax import LLM, SamplingParams
    from paged_jax.distributed import multihost
    llm = LLM(tiny_llama, **ENGINE)
    out = multihost.run(llm.engine, lambda: llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3),
                                                         use_tqdm=False))
    assert len(out[0].outputs[0].token_ids) == 3 and llm.engine.runner.on_step is None


# ---- two processes -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two JAX processes with gloo, each compiling its buckets
def test_two_processes_of_two_cpu_devices_equal_one_device(tmp_path):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    procs = [subprocess.Popen([sys.executable, __file__, f"--process_id={i}", "--num_processes=2",
                               f"--coordinator_address=127.0.0.1:{port}", "--num_cpu_devices=2",
                               f"--out={tmp_path / f'out{i}.json'}"], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    leader = json.loads((tmp_path / "out0.json").read_text())
    follower = json.loads((tmp_path / "out1.json").read_text())
    assert leader["process_count"] == 2 and leader["device_count"] == 4 and leader["tensor_parallel_size"] == 4
    assert follower["steps_followed"] == leader["steps_broadcast"] > 0  # the follower ran every step

    from paged_jax import LLM

    from paged_jax.baselines import reference
    model = _tiny_model()
    single = _generate(LLM(model, **ENGINE))
    logits = lambda ids: reference.prompt_logits(model.params, model.config, [ids])[0][-1]
    for prompt, expected, actual in zip(_prompts(), single, leader["outputs"]):
        assert len(actual) == MAX_TOKENS
        assert_greedy_match(prompt, expected, actual, logits)


def _worker(argv):
    del argv
    from absl import flags

    from paged_jax.distributed import multihost
    multihost.initialize(multihost.config_from_flags())
    import jax

    from paged_jax import LLM
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    llm = LLM(_tiny_model(), tensor_parallel_size=4, **ENGINE)
    result = multihost.run(llm.engine, lambda: _generate(llm))
    record = {"process_count": jax.process_count(), "device_count": jax.device_count(),
              "tensor_parallel_size": llm.engine.config.tensor_parallel_size}
    if jax.process_index() == 0:
        record.update(outputs=result, steps_broadcast=llm.engine.stats()["num_steps"])
    else:
        record.update(steps_followed=result)
    with open(flags.FLAGS.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    from absl import app, flags

    from paged_jax.distributed import multihost
    multihost.define_flags()
    flags.DEFINE_string("out", None, "Where this process writes its JSON record.")
    app.run(_worker)
