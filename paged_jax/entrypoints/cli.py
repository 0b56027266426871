"""The `paged-jax` console script, so that `pip install paged_jax` alone can serve:

    paged-jax serve [--model=smollm2-135m] [--port=8000] [--block_size=16] ...
    paged-jax serve --help

`serve` is `python -m experiments.serve_local` (the same flags and code,
paged_jax/entrypoints/serve.py).
"""

from __future__ import annotations

import sys

USAGE = """usage: paged-jax <command> [flags]

commands:
  serve    serve a model over OpenAI's API (paged-jax serve --help lists the flags)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if len(argv) >= 2 else 2
    if argv[1] != "serve":
        print(f"paged-jax: unknown command {argv[1]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    from absl import app, flags

    from paged_jax.entrypoints import serve
    serve.define_flags()
    for flag in flags.FLAGS.get_key_flags_for_module(serve):  # --help lists the key flags of sys.argv[0]
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    flags.FLAGS.set_default("verbosity", -1)  # absl logs INFO by default; -1 = warnings

    def run(args):
        del args
        serve.serve_from_flags()

    app.run(run, argv=[f"{argv[0]} serve", *argv[2:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
