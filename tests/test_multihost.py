"""The same run split over two processes with jax.distributed (each with 4 of the 8 virtual
CPU devices, collectives through gloo) gives the tokens of one process with all 8: under one
placement, with two-batch overlap, and with prefill and decode apart."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moejax.cli import main

pytestmark = pytest.mark.slow  # starts moejax processes

RUNNER = Path(__file__).parent / "multihost_runs.py"
MARK = "moejax run: "  # the runner's line before each run's output
ARGS = [
    "generate",
    "--preset",
    "tiny",
    "--devices",
    "8",
    "--prompt-ids",
    "1,2,3",
    "--prompt-ids",
    "4,5",
    "--max-new-tokens",
    "4",
    "--json",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUNS = {
    "ragged_a2a": ["--placement", "ragged_a2a"],
    "tensor_sliced": ["--placement", "tensor_sliced"],
    # Two micro-batches per device: each ragged exchange runs as two, across the processes too.
    "ragged_a2a_two_batch_overlap": ["--placement", "ragged_a2a", "--two-batch-overlap"],
    # Prefill and decode apart: each mesh takes 2 devices of each process; the hand-over is one
    # program over both meshes (jax's device_put refuses a reshard between them).
    "prefill_apart_from_decode": [
        "--prefill-placement",
        "ragged_a2a",
        "--decode-placement",
        "weight_prefetch",
        "--prefill-devices",
        "4",
        "--decode-devices",
        "4",
    ],
}


@pytest.fixture(scope="module")
def two_processes() -> list[dict]:
    """Each process's tokens of every run: the runs in turn, in one start-up of the two processes."""
    coordinator = f"127.0.0.1:{free_port()}"
    # Each process makes its own 4 devices; the suite's other XLA flags (cheap compiles) stay.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RUNNER),
                json.dumps(
                    [
                        [
                            run,
                            ARGS
                            + flags_
                            + ["--num-processes", "2", "--process-id", str(i), "--coordinator", coordinator],
                        ]
                        for run, flags_ in RUNS.items()
                    ]
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    tokens = [{} for _ in outs]
    for got, (out, _) in zip(tokens, outs):
        run = None
        for line in out.splitlines():  # gloo logs its connections on stdout too
            if line.startswith(MARK):
                run = line[len(MARK) :]
            elif line.startswith("{"):
                got[run] = json.loads(line)["tokens"]
    return tokens


@pytest.mark.parametrize("run", RUNS)
def test_two_processes_give_the_tokens_of_one(run, two_processes, capsys):
    assert main(ARGS + RUNS[run]) == 0
    expected = json.loads(capsys.readouterr().out)["tokens"]
    assert [out[run] for out in two_processes] == [expected, expected]
