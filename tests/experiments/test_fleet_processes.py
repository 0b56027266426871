"""A real local fleet (experiments/serve_fleet.py): serve_local replicas behind vllm-router.

Served answers through the router equal a replica's own; killing one replica mid-run
loses only what it was running (the router stops sending to it, every request sent
afterwards completes); a restarted replica gets traffic again; stopping the fleet
leaves no process behind. Needs the router's venv (experiments/setup_router.sh, run
here when missing: PyPI only) and two SmolLM2 replicas: slow.
"""

import asyncio
import os
import subprocess
import time

import httpx
import pytest

from experiments.benchmarks.fleet_processes import replica_counters
from experiments.serve_fleet import default_router_binary, make_fleet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLICA_FLAGS = ["--max_num_seqs=4", "--max_num_batched_tokens=64", "--max_model_len=256", "--seq_buckets=4",
                 "--token_buckets=16,64", "--layer_loop=scan"]
BODY = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


@pytest.mark.slow
def test_router_fleet_survives_a_dead_replica_and_takes_it_back(tmp_path):
    if not os.path.exists(default_router_binary()):
        subprocess.run(["bash", os.path.join(REPO, "experiments", "setup_router.sh")], check=True)
    fleet = make_fleet(2, policy="round_robin", port=18700, base_port=18701, replica_args=REPLICA_FLAGS,
                       log_dir=str(tmp_path))
    with fleet:
        direct = httpx.post(fleet.urls[0] + "/v1/completions", json=BODY, timeout=120).json()["choices"][0]["text"]
        routed = httpx.post(fleet.router_url + "/v1/completions", json=BODY, timeout=120).json()
        assert routed["choices"][0]["text"] == direct

        async def burst(n):
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(client.post(fleet.router_url + "/v1/completions", json=BODY,
                                                          timeout=120) for _ in range(n)), return_exceptions=True)
        async def burst_with_a_crash(n):  # replica 1 dies while both run their share of n long requests
            async with httpx.AsyncClient() as client:
                sent = [asyncio.create_task(client.post(fleet.router_url + "/v1/completions", timeout=120,
                                                        json={**BODY, "max_tokens": 48, "ignore_eos": True}))
                        for _ in range(n)]
                await asyncio.sleep(1.5)
                fleet.kill(1)
                return await asyncio.gather(*sent, return_exceptions=True)
        during = asyncio.run(burst_with_a_crash(8))
        lost = [r for r in during if isinstance(r, Exception) or r.status_code != 200]
        assert len(lost) <= 4, during  # at most replica 1's share (the router retries what it can)
        time.sleep(3)  # two failed health checks 1 s apart
        after = asyncio.run(burst(8))
        assert all(not isinstance(r, Exception) and r.status_code == 200 for r in after), after
        fleet.restart(1)
        time.sleep(3)
        served = replica_counters(fleet.urls[1])["success"]
        asyncio.run(burst(8))
        assert replica_counters(fleet.urls[1])["success"] > served  # the restarted replica serves again
        pids = [p.pid for p in fleet.replicas + [fleet.router]]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
