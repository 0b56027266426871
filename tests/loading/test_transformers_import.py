"""paged_jax imports transformers without its "PyTorch was not found" notice, and without
hiding anything else transformers logs (paged_jax/loading/transformers_import.py).

The runtime install has no torch; this venv has it (a test dependency), so the
subprocesses hide it the way an absent package looks to transformers:
`sys.modules["torch"] = None` makes `importlib.util.find_spec("torch")` return None,
which is how transformers decides (transformers.utils.import_utils.is_torch_available).
"""

import ast
import logging
import pathlib
import subprocess
import sys

from paged_jax.loading.transformers_import import TORCH_NOTICE, torch_notice_silenced

ROOT = pathlib.Path(__file__).resolve().parents[2]
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"


def _stderr_of(code: str) -> str:
    """stderr of `code` run in a fresh interpreter without torch, from the repository root."""
    done = subprocess.run([sys.executable, "-c", HIDE_TORCH + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_without_torch_a_plain_import_prints_the_notice():
    """The control: the simulation does make transformers print it, so its absence below
    is the fix's doing."""
    assert TORCH_NOTICE in _stderr_of("import transformers")


def test_paged_jax_loads_a_tokenizer_and_an_engine_module_without_the_notice():
    """The paths by which paged_jax imports transformers: the engine module (which `LLM`
    imports), the GGUF tokenizer module, and building a real tokenizer with it."""
    err = _stderr_of(
        "import paged_jax.engine.llm_engine\n"
        "from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer\n"
        "from paged_jax.loading.registry import resolve\n"
        "from paged_jax.loading.transformers_import import import_transformers\n"
        "tok = load_gguf_tokenizer(resolve('smollm2-135m'))\n"
        "assert 'transformers' in sys.modules\n"
        "assert isinstance(tok, import_transformers().PreTrainedTokenizerFast)\n"
        "assert tok.decode(tok.encode('Hello world')) == 'Hello world'\n")
    assert TORCH_NOTICE not in err, err


def _records_logged(messages: list[str], silenced: bool) -> list[str]:
    """What a handler on transformers' logger receives when `messages` are logged to it."""
    logger = logging.getLogger("transformers")
    received: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: received.append(record.getMessage())
    logger.addHandler(handler)
    try:
        if silenced:
            with torch_notice_silenced():
                for m in messages:
                    logger.warning(m)
        else:
            for m in messages:
                logger.warning(m)
    finally:
        logger.removeHandler(handler)
    return received


def test_only_the_notice_is_dropped_and_only_inside_the_block():
    notice = TORCH_NOTICE + " Models won't be available and only tokenizers, configuration and ..."
    other = "Special tokens have been added in the vocabulary, make sure the associated word embeddings are fine-tuned"
    filters_before = list(logging.getLogger("transformers").filters)
    assert _records_logged([notice, other], silenced=True) == [other]
    assert logging.getLogger("transformers").filters == filters_before  # nothing outlives the block
    assert _records_logged([notice, other], silenced=False) == [notice, other]


def _runtime_transformers_imports(path: pathlib.Path) -> list[int]:
    """Lines of `import transformers...` / `from transformers... import` outside
    `if TYPE_CHECKING:` blocks (those only name types for annotations)."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    lines = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
            lines.append(node.lineno)
    return lines


def test_paged_jax_imports_transformers_only_through_the_helper():
    """A direct import elsewhere could run first and print the notice again."""
    helper = ROOT / "paged_jax" / "loading" / "transformers_import.py"
    offenders = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "paged_jax").rglob("*.py"))
                 if p != helper and (lines := _runtime_transformers_imports(p))}
    assert offenders == {}, f"import transformers through paged_jax.loading.transformers_import: {offenders}"
