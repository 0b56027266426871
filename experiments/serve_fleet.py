"""A local fleet: N serve_local replicas behind vllm-router (or sglang-router) on loopback, until Ctrl-C.

    bash experiments/setup_router.sh && python -m experiments.serve_fleet --num_replicas=2
    bash experiments/setup_router.sh sglang && python -m experiments.serve_fleet --router=sglang
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
kv_transfer_params handshake. `--router=sglang` puts sglang-router in front instead
(no token-id prompts; its cache_aware spreads distinct prompts evenly, see router_command).
Ctrl-C or SIGTERM stops the router, then the replicas (each finishes what it runs within
its --shutdown_timeout).
"""

from __future__ import annotations

import os
import shlex
import signal
import threading

from absl import app, flags

from experiments.benchmarks.fleet_processes import Fleet

ROUTERS = ("vllm", "sglang")
ROUTER_VERSIONS = {"vllm": "vllm-router 0.1.17", "sglang": "sglang-router 0.2.3"}  # experiments/setup_router.sh's
ROUTER_POLICIES = {"vllm": ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash"),
                   "sglang": ("cache_aware", "round_robin", "power_of_two", "random")}
# a dead replica is dropped after 2 failed checks 1 s apart; a restarted one is used after 1 good check
# (both routers spell these the same: vllm-router began as a fork of sgl-router)
FAST_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--health-success-threshold", "1", "--cb-timeout-duration-secs", "5"]


def setup_command(router: str = "vllm") -> str:
    """The command that installs `router` (named in errors when it is missing)."""
    return "bash experiments/setup_router.sh" + (" sglang" if router == "sglang" else "")


def default_router_binary(router: str = "vllm") -> str:
    """experiments/setup_router.sh's install of `router` (ROUTER_VENV / SGLANG_ROUTER_VENV move it); for
    sglang-router, whose 0.2.3 has no console script, its venv's python (run with -m)."""
    if router == "sglang":
        venv = os.environ.get("SGLANG_ROUTER_VENV", os.path.expanduser("~/.cache/paged_jax/sglang-router-venv"))
        return os.path.join(venv, "bin", "python")
    venv = os.environ.get("ROUTER_VENV", os.path.expanduser("~/.cache/paged_jax/router-venv"))
    return os.path.join(venv, "bin", "vllm-router")


def router_command(binary: str, port: int, policy: str, *, router: str = "vllm", pd: bool = False,
                   prometheus_port: int | None = None, extra: list[str] = ()):
    """urls -> the router's argv fronting them (with --pd: urls[0] prefills, urls[1] decodes).

    Why two routers: their cache-aware policies differ where it matters for balance. Both send a
    request to the replica whose history matches most of its prompt, but a prompt that matches
    none goes, in vllm-router, to the replica with the fewest requests in flight (the first on a
    tie), and in sglang-router 0.2.3 to the replica whose prompt tree is smallest, which spreads
    distinct prompts evenly (sglang-router 0.2.4 and later switched to vllm-router's rule).
    sglang-router matches characters (vllm-router tokens) and refuses token-id prompts (422 from
    0.2.3 itself; chat, cache_salt and structured outputs pass) (docs/fleets.md).
    """
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if policy not in ROUTER_POLICIES[router]:
        raise ValueError(f"{router}-router has no policy {policy!r}; it has {ROUTER_POLICIES[router]}")
    if pd and router != "vllm":
        raise ValueError("--pd needs vllm-router: its prefill / decode mode is vLLM's kv_transfer_params "
                         "handshake, which sglang-router's (SGLang's bootstrap servers) is not")

    def command(urls: list[str]) -> list[str]:
        launcher = ["-m", "sglang_router.launch_router"] if router == "sglang" else []  # no console script
        argv = [binary, *launcher, "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port or port + 1000),
                *FAST_HEALTH, *extra]
        if pd:
            return argv + ["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
        return argv + ["--policy", policy, "--worker-urls", *urls]
    return command


def parse_run(value: str, default_router: str) -> tuple[str, str, str]:
    """experiments/fleet_prefix_routing.py's --run value, '[ROUTER:]POLICY [router flags]' -> (router,
    policy, router flags). Here with check_plan rather than there because that script defines its
    flags on import, which tests importing other experiments' flags beside it cannot do."""
    head, _, router_flags = value.strip().partition(" ")
    router, _, policy = head.rpartition(":")
    return router or default_router, policy, router_flags.strip()


def check_plan(plan: list[tuple[str, str, str]]) -> None:
    """ValueError for a run whose router or policy does not exist, or whose router is not installed.

    Why before anything starts: each fleet run takes minutes (~8 at 256 requests), and a typo in
    the last --run would otherwise surface only after the others had run, their figures lost."""
    for router, policy, _ in plan:
        router_command("", 0, policy, router=router)  # refuses an unknown router or a policy it lacks
    for router in dict.fromkeys(router for router, _, _ in plan):
        if not os.path.exists(default_router_binary(router)):
            raise ValueError(f"{default_router_binary(router)} not found: run `{setup_command(router)}` first")


def make_fleet(num_replicas: int, *, policy: str, port: int = 8000, base_port: int = 8001,
               replica_args: list[str] = (), pd: bool = False, binary: str | None = None,
               log_dir: str | None = None, router_args: list[str] = (), router: str = "vllm") -> Fleet:
    binary = binary or default_router_binary(router)
    command = router_command(binary, port, policy, router=router, pd=pd, extra=list(router_args))
    if not os.path.exists(binary):
        raise FileNotFoundError(f"{binary} not found: run `{setup_command(router)}` first")
    if pd:
        num_replicas = 2
        replica_args = [*replica_args, "--kv_transfer", "--kv_connector=jax_transfer"]
    return Fleet(num_replicas, base_port=base_port, replica_args=list(replica_args),
                 router_command=command, router_port=port, log_dir=log_dir)


def _define_flags():
    flags.DEFINE_integer("num_replicas", 2, "serve_local replicas (each its own engine and process).")
    flags.DEFINE_enum("router", "vllm", list(ROUTERS), "Which router fronts the replicas: vllm-router (every "
                      "vLLM request extension, prefill / decode mode) or sglang-router 0.2.3 (no token-id prompts, "
                      "no --pd; its cache_aware spreads distinct prompts evenly).")
    flags.DEFINE_enum("policy", "cache_aware", list(ROUTER_POLICIES["vllm"]), "The router's routing policy "
                      "(sglang-router has no consistent_hash).")
    flags.DEFINE_integer("port", 8000, "The router's port: clients use http://127.0.0.1:<port>/v1.")
    flags.DEFINE_integer("base_port", 8001, "Replica i listens on base_port + i.")
    flags.DEFINE_string("replica_flags", "", "Extra serve_local flags for every replica (one shell-quoted string).")
    flags.DEFINE_string("router_flags", "", "Extra router flags (one shell-quoted string), e.g. "
                                            "'--balance-abs-threshold 2'.")
    flags.DEFINE_bool("pd", False, "One prefill and one decode replica behind the router's prefill / decode mode.")
    flags.DEFINE_string("router_binary", None, "Router executable, for sglang-router the python of its venv "
                                             "(default: experiments/setup_router.sh's).")
    flags.DEFINE_string("fleet_log_dir", "/tmp/paged_jax-fleet", "Where each process's log goes (replica<i>.log, "
                                                           "router.log).")


def main(argv):
    del argv
    f = flags.FLAGS
    try:
        fleet = make_fleet(f.num_replicas, policy=f.policy, port=f.port, base_port=f.base_port,
                           replica_args=shlex.split(f.replica_flags), pd=f.pd, binary=f.router_binary,
                           router_args=shlex.split(f.router_flags), router=f.router,
                           log_dir=f.fleet_log_dir)
    except (FileNotFoundError, ValueError) as exc:
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
