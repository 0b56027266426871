"""load_model parses a GGUF's header once for both the weights and the tokenizer (SmolLM2's
vocabulary and merges are ~200k strings: a parse costs about a third of a second here)."""

from paged_jax.loading import gguf_file, load_model


def test_smollm2_header_is_parsed_once(monkeypatch):
    opened = []
    init = gguf_file.GGUFFile.__init__

    def counting(self, path, *args, **kwargs):
        opened.append(path)
        init(self, path, *args, **kwargs)
    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", counting)
    loaded = load_model("smollm2-135m")
    assert len(opened) == 1, opened
    assert loaded.tokenizer is not None and loaded.tokenizer("Hello").input_ids  # both came from it
