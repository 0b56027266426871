"""A local fleet: N serve_local replicas behind vllm-router on loopback, until Ctrl-C.

    bash experiments/setup_router.sh && python -m experiments.serve_fleet --num_replicas=2
    python -m experiments.serve_fleet --num_replicas=4 --policy=round_robin --replica_flags=--max_num_seqs=16
    python -m experiments.serve_fleet --pd                     # 1 prefill + 1 decode replica

Clients talk to the router (http://127.0.0.1:8000/v1, OpenAI's API as one server would);
the replicas listen on --base_port, --base_port + 1, ... Each replica is a whole engine
in its own process (experiments/benchmarks/fleet_processes.py); the router is vLLM's
(vllm-router, installed by experiments/setup_router.sh into its own venv) with its
health checks tightened (every second; a replica is dropped after two failures and
taken back after one success). `--policy cache_aware` sends requests that share a prefix to the
replica that served it (the router asks the replicas' /tokenize for token ids);
`--pd` starts one prefill and one decode replica (--kv_transfer
--kv_connector=jax_transfer) and the router's prefill / decode mode, which speaks vLLM's
kv_transfer_params handshake. Ctrl-C or SIGTERM stops the router, then the replicas
(each finishes what it runs within its --shutdown_timeout).
"""

from __future__ import annotations

import os
import shlex
import signal
import threading

from absl import app, flags

from experiments.benchmarks.fleet_processes import Fleet

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")
# a dead replica is dropped after 2 failed checks 1 s apart; a restarted one is used after 1 good check
FAST_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--health-success-threshold", "1", "--cb-timeout-duration-secs", "5"]


def default_router_binary() -> str:
    venv = os.environ.get("ROUTER_VENV", os.path.expanduser("~/.cache/paged_jax/router-venv"))
    return os.path.join(venv, "bin", "vllm-router")


def router_command(binary: str, port: int, policy: str, *, pd: bool = False, prometheus_port: int | None = None,
                   extra: list[str] = ()):
    """urls -> vllm-router's argv fronting them (with --pd: urls[0] prefills, urls[1] decodes)."""
    def command(urls: list[str]) -> list[str]:
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(prometheus_port or port + 1000), *FAST_HEALTH, *extra]
        if pd:
            return argv + ["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
        return argv + ["--policy", policy, "--worker-urls", *urls]
    return command


def make_fleet(num_replicas: int, *, policy: str, port: int = 8000, base_port: int = 8001,
               replica_args: list[str] = (), pd: bool = False, binary: str | None = None,
               log_dir: str | None = None, router_args: list[str] = ()) -> Fleet:
    binary = binary or default_router_binary()
    if not os.path.exists(binary):
        raise FileNotFoundError(f"{binary} not found: run `bash experiments/setup_router.sh` first")
    if pd:
        num_replicas = 2
        replica_args = [*replica_args, "--kv_transfer", "--kv_connector=jax_transfer"]
    return Fleet(num_replicas, base_port=base_port, replica_args=list(replica_args),
                 router_command=router_command(binary, port, policy, pd=pd, extra=list(router_args)), router_port=port, log_dir=log_dir)


def _define_flags():
    flags.DEFINE_integer("num_replicas", 2, "serve_local replicas (each its own engine and process).")
    flags.DEFINE_enum("policy", "cache_aware", list(ROUTER_POLICIES), "vllm-router's routing policy.")
    flags.DEFINE_integer("port", 8000, "The router's port: clients use http://127.0.0.1:<port>/v1.")
    flags.DEFINE_integer("base_port", 8001, "Replica i listens on base_port + i.")
    flags.DEFINE_string("replica_flags", "", "Extra serve_local flags for every replica (one shell-quoted string).")
    flags.DEFINE_string("router_flags", "", "Extra vllm-router flags (one shell-quoted string), e.g. "
                                            "'--balance-abs-threshold 2'.")
    flags.DEFINE_bool("pd", False, "One prefill and one decode replica behind the router's prefill / decode mode.")
    flags.DEFINE_string("router_binary", None, "vllm-router executable (default: experiments/setup_router.sh's).")
    flags.DEFINE_string("fleet_log_dir", "/tmp/paged_jax-fleet", "Where each process's log goes (replica<i>.log, "
                                                           "router.log).")


def main(argv):
    del argv
    f = flags.FLAGS
    try:
        fleet = make_fleet(f.num_replicas, policy=f.policy, port=f.port, base_port=f.base_port,
                           replica_args=shlex.split(f.replica_flags), pd=f.pd, binary=f.router_binary,
                           router_args=shlex.split(f.router_flags),
                           log_dir=f.fleet_log_dir)
    except FileNotFoundError as exc:
        raise app.UsageError(str(exc)) from exc
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"starting {len(fleet.ports)} replicas (logs in {f.fleet_log_dir}) ...", flush=True)
    try:
        fleet.start()
        print(f"fleet ready: {fleet.router_url}/v1 -> {' '.join(fleet.urls)} "
              f"({'prefill / decode' if f.pd else f.policy}); Ctrl-C stops it", flush=True)
        stop.wait()
    finally:
        print("stopping the fleet ...", flush=True)
        fleet.stop()
        print("fleet stopped", flush=True)


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
