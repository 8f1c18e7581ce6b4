"""`moejax` command line. Each verb lives in its own module and registers itself here.

Errors a user can cause end as one line on stderr and exit code 2 (argparse's own
convention for bad arguments), never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from moejax.config import ConfigError
from moejax.launch.startup import (
    configure_compile_cache,
    host_pages,
    jax_platforms,
    quiet_native_logs,
    start_tpu_compiler_quietly,
)

# Modules that define `register(subparsers)`; each subparser sets `func(args) -> int`.
VERB_MODULES = (
    "moejax.verbs.commands",
    "moejax.verbs.compare",
    "moejax.verbs.plan_command",
    "moejax.analysis.measure_verbs",
    "moejax.analysis.advise_verb",
    "checkpoints.commands",
    "moejax.serving.commands",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"moejax: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="moejax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    for name in VERB_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before build_parser, whose verb modules import jax: XLA's C++ logs quiet, and compiled
    # programs persisting between runs (XLA:CPU compiles are most of a short run's time).
    quiet_native_logs()
    configure_compile_cache()
    jax_platforms()
    host_pages()
    args = build_parser().parse_args(argv)
    try:
        from moejax.launch.factory import init_processes

        init_processes(args)
        start_tpu_compiler_quietly(getattr(args, "target", None))
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"moejax: error: {e}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "num_processes", 1) > 1:  # leave together: a lone exit aborts the others
            import jax

            jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
