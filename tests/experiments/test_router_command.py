"""The router argv experiments/serve_fleet.py builds, and fleet_prefix_routing's --run values.

No processes: what each router is told (its subcommand, policy, worker URLs, the tightened
health checks), the combinations refused before anything starts, how a --run value names
its router, policy and flags, that the versions recorded are the ones setup_router.sh
installs, and the setup a results-table row asks for.
"""

import os
import re

import pytest

from experiments.results_table import router_setup
from experiments.serve_fleet import FAST_HEALTH, ROUTER_VERSIONS, check_plan, parse_run, router_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def test_vllm_router_argv():
    argv = router_command("/bin/vllm-router", 9000, "cache_aware", extra=["--balance-abs-threshold", "4"])(URLS)
    assert argv[0] == "/bin/vllm-router" and argv[1] == "--host"
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--worker-urls") + 1:] == URLS
    assert argv[argv.index("--balance-abs-threshold") + 1] == "4"
    assert " ".join(FAST_HEALTH) in " ".join(argv)


def test_sglang_router_argv_launches_with_the_same_flags():
    argv = router_command("/venv/bin/python", 9000, "cache_aware", router="sglang")(URLS)
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang_router.launch_router"]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--worker-urls") + 1:] == URLS
    assert " ".join(FAST_HEALTH) in " ".join(argv)


def test_vllm_pd_argv():
    argv = router_command("/bin/vllm-router", 9000, "cache_aware", pd=True)(URLS)
    assert argv[-5:] == ["--vllm-pd-disaggregation", "--prefill", URLS[0], "--decode", URLS[1]]
    assert "--policy" not in argv


@pytest.mark.parametrize("kwargs, message", [
    ({"router": "sglang", "pd": True}, "needs vllm-router"),
    ({"router": "nginx"}, "router must be one of"),
])
def test_refused_combinations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        router_command("/bin/x", 9000, "cache_aware", **kwargs)


def test_policy_must_be_the_routers():
    router_command("/bin/x", 9000, "consistent_hash")  # vllm-router has it
    with pytest.raises(ValueError, match="no policy 'consistent_hash'"):
        router_command("/bin/x", 9000, "consistent_hash", router="sglang")


@pytest.mark.parametrize("value, expected", [
    ("round_robin", ("vllm", "round_robin", "")),
    ("sglang:cache_aware", ("sglang", "cache_aware", "")),
    ("cache_aware --balance-abs-threshold 4  --balance-rel-threshold 1.5",
     ("vllm", "cache_aware", "--balance-abs-threshold 4  --balance-rel-threshold 1.5")),
    (" sglang:cache_aware --cache-threshold 0.5 ", ("sglang", "cache_aware", "--cache-threshold 0.5")),
])
def test_parse_run(value, expected):
    assert parse_run(value, "vllm") == expected


def test_parse_run_default_router():
    assert parse_run("cache_aware", "sglang") == ("sglang", "cache_aware", "")


@pytest.fixture
def router_venvs(tmp_path, monkeypatch):
    """Both routers 'installed' under tmp_path (an empty file where each executable goes)."""
    for name, variable, binary in (("vllm", "ROUTER_VENV", "vllm-router"), ("sglang", "SGLANG_ROUTER_VENV", "python")):
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "bin" / binary).touch()
        monkeypatch.setenv(variable, str(tmp_path / name))
    return tmp_path


def test_check_plan_passes_a_good_plan(router_venvs):
    check_plan([("vllm", "round_robin", ""), ("vllm", "consistent_hash", "--balance-abs-threshold 4"),
                ("sglang", "cache_aware", "")])


@pytest.mark.parametrize("plan, message", [
    ([("vllm", "round_robin", ""), ("nginx", "cache_aware", "")], "router must be one of"),
    ([("vllm", "cache_aware", ""), ("sglang", "consistent_hash", "")], "no policy 'consistent_hash'"),
    ([("vllm", "cache_awar", "")], "no policy 'cache_awar'"),
])
def test_check_plan_refuses_a_bad_run_wherever_it_is(router_venvs, plan, message):
    with pytest.raises(ValueError, match=message):
        check_plan(plan)


def test_check_plan_names_the_missing_routers_setup(router_venvs, monkeypatch):
    monkeypatch.setenv("SGLANG_ROUTER_VENV", str(router_venvs / "absent"))
    check_plan([("vllm", "cache_aware", "")])  # sglang-router's absence matters only to a run that uses it
    with pytest.raises(ValueError, match=r"run `bash experiments/setup_router.sh sglang` first"):
        check_plan([("vllm", "cache_aware", ""), ("sglang", "cache_aware", "")])


def test_recorded_router_versions_are_the_installed_ones():
    with open(os.path.join(REPO, "experiments", "setup_router.sh")) as f:
        specs = dict(re.findall(r'SPEC="(\w+)-router==([\d.]+)"', f.read()))
    assert {router: f"{router}-router {version}" for router, version in specs.items()} == ROUTER_VERSIONS


@pytest.mark.parametrize("routers, setup", [
    (None, "bash experiments/setup_router.sh"),  # records from before a run named its router
    ("vllm-router 0.1.17", "bash experiments/setup_router.sh"),
    ("sglang-router 0.2.3", "bash experiments/setup_router.sh sglang"),
    ("sglang-router 0.2.3, vllm-router 0.1.17",
     "bash experiments/setup_router.sh && bash experiments/setup_router.sh sglang"),
])
def test_results_row_asks_for_the_routers_that_ran(routers, setup):
    record = {"command": "python -m experiments.fleet_prefix_routing --output=not_sglang", "figures": {}}
    if routers:
        record["figures"]["router"] = routers
    assert router_setup(record) == setup
