"""What the device programs of one scheduler step need, as data: the step plan.

A step is a short sequence of program calls (a decode over the first W slots, prefill chunks,
the fork of n samples, an expert move, MTP's target+draft programs). Each call is a `Call`: the
program's name, its host-side inputs as named numpy arrays (slot indices, token ids, positions,
sampling parameters and seeds, a routing override's picks, the experts' new placement) and its
static flags (which compiled variant: greedy only, with logprobs, which results to read back).
No activations and no cache: every process holds its own shards of those.

The scheduler runs every program through a `Call` (`Scheduler._run`), on one process too; with
several processes, process 0 sends each call to the others before running it itself
(`serving/plan_link.py`), so all run the same programs in the same order with the same shapes.
A call goes out as soon as it is decided, not a whole step at once: the fork of n samples takes
the logits the prefill before it produced (read back on process 0), and a follower must not wait
for the end of a step to start the collective that process 0 is already in.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

_HEADER = struct.Struct("<I")  # bytes of the JSON header that follows


@dataclasses.dataclass
class Call:
    """One device program call: `name` (the scheduler's `_do_<name>`), its host inputs and flags."""

    name: str
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    flags: dict[str, bool | int | str] = dataclasses.field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """JSON header (name, flags, each array's dtype and shape) then the arrays' raw bytes."""
        arrays = {k: np.asarray(v) for k, v in self.arrays.items()}
        header = json.dumps(
            {
                "name": self.name,
                "flags": self.flags,
                "arrays": [[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()],
            },
            separators=(",", ":"),
        ).encode()
        return b"".join([_HEADER.pack(len(header)), header, *(v.tobytes() for v in arrays.values())])

    @classmethod
    def from_bytes(cls, data: bytes) -> Call:
        (n,) = _HEADER.unpack_from(data)
        header = json.loads(data[_HEADER.size : _HEADER.size + n])
        at, arrays = _HEADER.size + n, {}
        for k, dtype, shape in header["arrays"]:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[k] = np.frombuffer(data, dtype, count=count, offset=at).reshape(shape)
            at += count * dtype.itemsize
        if at != len(data):
            raise ValueError(f"a step plan call of {len(data)} bytes holds {at}")
        return cls(header["name"], arrays, header["flags"])


def flat(prefix: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` (a program's sampling dict) as call inputs named `prefix.key`."""
    return {f"{prefix}.{k}": v for k, v in arrays.items()}


def nested(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The inputs `flat` named `prefix.key`, back as a dict by key."""
    start = prefix + "."
    return {k[len(start) :]: v for k, v in arrays.items() if k.startswith(start)}
