"""One process of a two-process start-up that runs several `moejax generate` cases in turn
(test_multihost.py): jax.distributed starts once for all of them, not once per case.
argv: a JSON list of [name, generate argv] pairs; each case's output follows a line `moejax run: NAME`."""

from __future__ import annotations

import json
import sys


def main(cases: list[list]) -> int:
    from moejax.launch.startup import configure_compile_cache

    configure_compile_cache()  # before the parser's verb modules import jax
    from moejax.cli import build_parser
    from moejax.launch.factory import init_processes

    parsed = [(name, build_parser().parse_args(argv)) for name, argv in cases]
    init_processes(parsed[0][1])  # every case runs on the same processes and devices
    import jax

    try:
        for name, args in parsed:
            print(f"moejax run: {name}", flush=True)
            if int(args.func(args) or 0):
                return 1
            sys.stdout.flush()
    finally:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
