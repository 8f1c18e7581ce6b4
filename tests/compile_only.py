"""Abstract arrays on a compile-only accelerator (`moejax.base.targets`): a jit lowered and compiled over
them runs the target's own compiler (XLA:GPU's Triton lowering for an H100), here, without one."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from moejax.base import targets


def on(target: str, shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract array on one compile-only device of `target`."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(targets.devices(target, 1)[0]))


def on_h100(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract array on a compile-only H100."""
    return on("h100", shape, dtype)


def lower(jitted, *args, **kwargs):
    """`jitted` lowered over `args` (abstract arrays on a target's compile-only devices) for that
    target (`targets.lowering`: the GPU Pallas's Triton lowering writes for)."""
    with targets.lowering(*args):
        return jitted.lower(*args, **kwargs)


def in_own_process(script: str):
    """The JSON `python script OUT` writes to OUT, run in a process of its own: the first GPU
    architecture a process assembles a Mosaic GPU kernel for is the one ptxas assembles every later
    kernel for (jaxlib 0.10.2), so a B200's kernels compile apart from the H100's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        root = str(Path(__file__).parents[1])  # moejax and pallas_kernels, whether installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, script, str(out)], check=True, capture_output=True, env=env)
        return json.loads(out.read_text())
