"""Hugging Face Hub ids (`LLM("Qwen/Qwen3-0.6B")`) resolved to a local snapshot directory.

What every vLLM user types. `owner/name` (optionally `owner/name@revision`: a branch, a
tag or a commit) is looked up with `huggingface_hub.snapshot_download` in the Hub cache,
laid out as huggingface_hub lays it out (models--owner--name/refs, snapshots, blobs), so
a model fetched by `hf download`, transformers or vLLM is found where they left it. The
snapshot directory is an ordinary Hugging Face directory, which the HF loader reads.

The environment is read when a model is resolved, not when huggingface_hub was imported
(its `constants` are frozen at import): HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub; HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) means the cache
only. Online, a missing model is downloaded, as vLLM does, restricted to the files the
loader reads (a repo's PyTorch .bin, ONNX or GGUF copies are not fetched).
huggingface_hub is imported only when a Hub id is resolved: other sources do not pay for it.
"""

from __future__ import annotations

import os

from paged_jax.loading.errors import detail

# Files the Hugging Face directory loader reads: config.json, *.safetensors and their index,
# the tokenizer (tokenizer.json / tokenizer_config.json / vocab.json + merges.txt /
# tokenizer.model) and the chat template (chat_template.jinja in newer repos).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "tokenizer.model", "*.jinja"]
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true environment switch


def split_revision(model: str) -> tuple[str, str | None]:
    """'owner/name@rev' -> ('owner/name', 'rev'); no '@' -> (model, None)."""
    repo_id, at, revision = model.partition("@")
    return repo_id, (revision if at else None)


def hub_id_problem(model: str) -> str | None:
    """None when `model` is a well-formed Hub id ('owner/name', optionally '@revision');
    otherwise what is wrong with it. A bare 'name' is not taken as a Hub id here: bare
    names are paged_jax's registered names."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    repo_id, revision = split_revision(model)
    if repo_id.count("/") != 1:
        return f"a Hub id has exactly one '/' (owner/name), {repo_id!r} has {repo_id.count('/')}"
    if revision is not None and not revision.strip():
        return "the revision after '@' is empty"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        return str(err)
    return None


def hub_cache_dir() -> str:
    """The Hub cache huggingface_hub uses, from the environment as it is now."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(cache))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now, or when huggingface_hub was imported."""
    from huggingface_hub import constants
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE or constants.HF_HUB_OFFLINE


def download_hint(model: str) -> str:
    """How to get `model` into the cache, as a sentence."""
    repo_id, revision = split_revision(model)
    command = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return (f"Get it with `{command}` (huggingface_hub's CLI) on a machine with network access, into this cache "
            "or one that HF_HUB_CACHE or HF_HOME points at; paged_jax downloads it itself when online "
            "(HF_HUB_OFFLINE=1 stops downloads)")


def resolve(model: str) -> str:
    """The local snapshot directory of Hub id `model`; ValueError naming the id, the cache
    searched and what to run when it is neither cached nor (online) downloadable."""
    from huggingface_hub import errors, snapshot_download

    problem = hub_id_problem(model)
    if problem is not None:
        raise ValueError(f"{model!r} is not a Hugging Face Hub id: {problem}")
    repo_id, revision = split_revision(model)
    cache, offline = hub_cache_dir(), hub_offline()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                 allow_patterns=ALLOW_PATTERNS)
    except (errors.LocalEntryNotFoundError, errors.HfHubHTTPError) as err:
        where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
        # A snapshot interrupted mid-download (huggingface_hub >= 1.x tells it apart).
        partial = isinstance(err, getattr(errors, "IncompleteSnapshotError", ()))
        # Offline, huggingface_hub's own text ("pass local_files_only=False") names an argument
        # the user never passed; the reason is HF_HUB_OFFLINE, said in the user's terms.
        why = ("HF_HUB_OFFLINE is set, so nothing was downloaded" if offline else "downloading it failed") + (
            f": {detail(err)}" if partial or not offline else "")
        raise ValueError(
            f"model {model!r} is not a local file or directory, and the Hugging Face Hub model {where} "
            f"is {'only partly' if partial else 'not'} in the Hub cache {cache} ({why}). "
            f"{download_hint(model)}") from err
