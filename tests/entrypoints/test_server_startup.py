"""The server's start-up as a newcomer sees it: a progress bar over the buckets while they
compile, no library notice that reads as an error, and one last line, printed once the
port is bound, saying where it serves (then it answers)."""

import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max_num_seqs=2", "--max_num_batched_tokens=16", "--seq_buckets=2", "--token_buckets=8,16",
                "--max_model_len=64", "--block_size=8", "--num_blocks=32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_smollm2_vocab")
    save_tiny_smollm2_vocab(str(path))
    return path


def test_start_up_shows_progress_then_one_ready_line(tiny_model_dir, tmp_path):
    port = _free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "experiments.serve_local", f"--model={tiny_model_dir}",
                                   "--served_model_name=tiny", f"--port={port}", *ENGINE_FLAGS],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready = f"serving tiny on http://127.0.0.1:{port} (OpenAI API at /v1; dashboard at /dashboard)"
    try:
        deadline = time.monotonic() + 300
        while ready not in log_path.read_text(errors="replace"):
            assert server.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.5)
        time.sleep(1.0)  # anything start-up still printed would be after the ready line now
        console = log_path.read_text(errors="replace")
        lines = [line.strip() for line in console.replace("\r", "\n").splitlines() if line.strip()]
        assert lines[-1] == ready, console  # the last line of start-up
        # the bar (tqdm, on stderr): 2 buckets and the rest, with how far it got
        assert re.search(r"compiling buckets: +\d+%\|[^|]*\| [123]/3 \[", console), console
        assert "Unable to initialize backend" not in console and "PyTorch was not found" not in console, console
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            assert response.status == 200  # ready means ready
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
