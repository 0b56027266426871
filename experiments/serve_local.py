"""Serve a model over OpenAI's API on this machine: `python -m experiments.serve_local`.

The same server as the console script `paged-jax serve` (paged_jax/entrypoints/serve.py:
flags, model loading, warm-up, uvicorn on 127.0.0.1:8000); `--help` lists every flag.
"""

from __future__ import annotations

from absl import app, flags

from paged_jax.entrypoints import serve

serve.define_flags()
flags.adopt_module_key_flags(serve)  # --help lists every flag


def main(argv):
    del argv
    serve.serve_from_flags()


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)  # absl logs INFO by default; -1 = warnings (--verbosity=0 restores)
    app.run(main)
