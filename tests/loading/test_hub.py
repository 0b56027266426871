"""Hugging Face Hub ids load from the Hub cache (paged_jax/loading/hub.py).

No network here, so the cache is built in the test: a tiny random-weight Llama with
SmolLM2's tokenizer (tests/helpers/tiny_smollm2_vocab.py), written into
models--owner--name/{blobs,snapshots/<commit>,refs/main} as huggingface_hub writes a
download (blobs named by their git or LFS hash, snapshot files relative symlinks to
them), and shown to be that layout by huggingface_hub's own readers (scan_cache_dir,
try_to_load_from_cache). HF_HUB_CACHE points at it and HF_HUB_OFFLINE=1, set per test
after huggingface_hub was imported: paged_jax reads them when it resolves a model.
"""

import hashlib
import os
import pathlib

import jax
import numpy as np
import pytest
from huggingface_hub import scan_cache_dir, try_to_load_from_cache

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.loading import hub, load_model
from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab

REPO_ID = "tiny-org/tiny-smollm2-vocab"
COMMIT = hashlib.sha1(b"the one commit of " + REPO_ID.encode()).hexdigest()
ENGINE = dict(block_size=8, num_blocks=32, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              seq_buckets=(2,), token_buckets=(16,))


def _blob_name(path: pathlib.Path) -> str:
    """What the Hub calls a file's content: sha256 for LFS files (the weights), the git
    blob sha1 for the rest; huggingface_hub names each blob after it."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(cache: pathlib.Path, repo_id: str, source: pathlib.Path, commit: str,
                    refs: tuple[str, ...] = ("main",)) -> pathlib.Path:
    """Put the files of `source` into `cache` as huggingface_hub's download of `repo_id` at
    `commit` leaves them; returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        blob = repo / "blobs" / _blob_name(file)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(the cache directory, the model directory it was built from, the snapshot directory)."""
    source = tmp_path_factory.mktemp("hf_dir")
    save_tiny_smollm2_vocab(str(source))
    cache = tmp_path_factory.mktemp("hub_cache")
    snapshot = write_hub_cache(cache, REPO_ID, source, COMMIT)
    return cache, source, snapshot


@pytest.fixture(autouse=True)
def offline_env(monkeypatch, hub_cache):
    """The cache is the only place to look, as on a machine without network."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_cache_is_what_huggingface_hub_reads(hub_cache):
    cache, source, snapshot = hub_cache
    (repo,) = scan_cache_dir(cache).repos
    assert (repo.repo_id, repo.repo_type) == (REPO_ID, "model")
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in source.iterdir()}
    found = try_to_load_from_cache(REPO_ID, "config.json", cache_dir=cache)
    assert found == str(snapshot / "config.json")
    assert pathlib.Path(found).read_bytes() == (source / "config.json").read_bytes()


def test_load_model_by_hub_id_is_loading_the_snapshot_directory(hub_cache):
    _, source, snapshot = hub_cache
    by_id, by_path = load_model(REPO_ID), load_model(str(source))
    assert by_id.kind == "hf" and by_id.source == str(snapshot)
    assert by_id.config == by_path.config
    jax.tree.map(np.testing.assert_array_equal, by_id.params, by_path.params)
    text = "Hello, Hub cache!"
    assert by_id.tokenizer.encode(text) == by_path.tokenizer.encode(text)


def test_llm_by_hub_id_generates_what_the_directory_generates(hub_cache):
    _, source, _ = hub_cache
    prompts = ["The capital of France is", "1, 2, 3,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    by_id = LLM(REPO_ID, **ENGINE).generate(prompts, greedy, use_tqdm=False)
    by_path = LLM(str(source), **ENGINE).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_id] == [o.outputs[0].token_ids for o in by_path]
    assert all(len(o.outputs[0].token_ids) == 12 for o in by_id)


def test_a_revision_picks_its_snapshot(hub_cache):
    cache, _, snapshot = hub_cache
    assert hub.resolve(f"{REPO_ID}@{COMMIT}") == str(snapshot)  # a commit: its snapshot, no ref needed
    assert hub.resolve(f"{REPO_ID}@main") == str(snapshot)
    with pytest.raises(ValueError) as err:
        hub.resolve(f"{REPO_ID}@v9")  # no such ref in the cache: not quietly main
    assert "revision 'v9'" in str(err.value) and f"hf download {REPO_ID} --revision v9" in str(err.value)


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(hub_cache, monkeypatch, tmp_path):
    _, source, _ = hub_cache
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    snapshot = write_hub_cache(tmp_path / "hf_home" / "hub", REPO_ID, source, COMMIT)
    assert hub.resolve(REPO_ID) == str(snapshot)


def test_a_missing_repo_says_where_it_looked_and_what_to_run(hub_cache):
    cache, _, _ = hub_cache
    with pytest.raises(ValueError) as err:
        load_model("tiny-org/not-downloaded")
    message = str(err.value)
    for part in ("'tiny-org/not-downloaded'", str(cache), "hf download tiny-org/not-downloaded",
                 "HF_HUB_OFFLINE=1 stops downloads", "HF_HUB_OFFLINE is set, so nothing was downloaded"):
        assert part in message, (part, message)


def test_a_partly_downloaded_snapshot_is_named_as_such(hub_cache, tmp_path, monkeypatch):
    """A download cut short: huggingface_hub's tree listing of the commit names the weights,
    the snapshot lacks them. Said as such, not as "not in the cache" nor as a load error."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache  # the listing a download writes
    _, source, _ = hub_cache
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_bytes((source / "config.json").read_bytes())
    repo_id = "tiny-org/cut-short"
    snapshot = write_hub_cache(cache, repo_id, only_config, COMMIT)
    listing = {name: TreeCacheEntry(size=(source / name).stat().st_size, blob_id=_blob_name(source / name))
               for name in ("config.json", "model.safetensors")}
    write_tree_cache(str(snapshot.parent.parent), COMMIT, listing)
    with pytest.raises(ValueError) as err:
        load_model(repo_id)
    message = str(err.value)
    for part in (f"{repo_id} is only partly in the Hub cache {cache}", "IncompleteSnapshotError", "model.safetensors",
                 f"hf download {repo_id}"):
        assert part in message, (part, message)


@pytest.mark.parametrize("model,problem", [
    ("tiny-org/two words", "alphanumeric"),  # huggingface_hub's own rule, passed on
    ("tiny-org/a--b", "--"),
    ("a/b/c", "exactly one '/'"),
    (f"{REPO_ID}@", "revision after '@' is empty"),
])
def test_a_string_that_is_no_source_names_every_accepted_form(model, problem):
    with pytest.raises(ValueError) as err:
        load_model(model)
    message = str(err.value)
    for part in (repr(model), "does not exist as a file or directory", "not a Hugging Face Hub id", problem,
                 "registered name ['smollm2-135m']", ".gguf file", "Hugging Face directory", "checkpoint",
                 "Hugging Face Hub id 'owner/name'"):
        assert part in message, (part, message)


def test_a_local_directory_named_like_a_hub_id_wins(hub_cache, tmp_path, monkeypatch):
    """As in vLLM: an existing path is a path, even when it also reads as owner/name."""
    _, source, _ = hub_cache
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / REPO_ID).symlink_to(source)
    assert load_model(REPO_ID).source == str(tmp_path / REPO_ID)
