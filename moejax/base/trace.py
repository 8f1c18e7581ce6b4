"""The router-pick trace: what `moejax record` writes and `moejax analyze` reads.

File format: one `.npz` (numpy, no pickle) holding, for S forward passes and L MoE layers:

    ids       int[S, L, R, k]    picked expert ids (logical ids, 0..num_experts-1) of every row; stored
                                 as the smallest unsigned type that holds num_experts - 1, loaded as int32
    valid     bool[S, R]         False for padding rows (steps hold different row counts; R is the max)
    kind      str[S]             "decode" or "prefill" per forward pass
    layers    int32[L]           model layer index of each traced MoE layer
    num_experts  int32[]         E
    model     str[]              free text naming the model (preset name, checkpoint path, "synthetic ...")

k is ids.shape[-1]. The ids of a padding row are meaningless (write 0). A row is one token's hidden
vector; rows keep the batch order of the forward pass, so under DP attention the rows of device d
are a contiguous block (see metrics.own_devices).

The recorder writes this as an output of the jitted step: per step it returns ids[L, R, k] and the
host stacks steps, pads rows and calls `save_trace`.
"""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import numpy as np

from moejax.base.errors import UsageError

KINDS = ("decode", "prefill")


@dataclasses.dataclass(frozen=True)
class Trace:
    ids: np.ndarray  # int32[S, L, R, k]
    valid: np.ndarray  # bool[S, R]
    kind: np.ndarray  # str[S]
    layers: np.ndarray  # int32[L]
    num_experts: int
    model: str

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    @property
    def num_steps(self) -> int:
        return self.ids.shape[0]

    def step_ids(self, step: int) -> np.ndarray:
        """int32[L, R_s, k]: the picks of one forward pass, padding rows dropped."""
        return self.ids[step][:, self.valid[step]]

    def select(self, steps: np.ndarray) -> Trace:
        """The same trace restricted to `steps` (indices or a bool mask over S)."""
        return dataclasses.replace(self, ids=self.ids[steps], valid=self.valid[steps], kind=self.kind[steps])


def validate(trace: Trace) -> Trace:
    if trace.ids.ndim != 4:
        raise UsageError(f"trace ids must be int[steps, layers, rows, k], got shape {trace.ids.shape}")
    s, l, r, k = trace.ids.shape
    if trace.valid.shape != (s, r) or trace.kind.shape != (s,) or trace.layers.shape != (l,):
        raise UsageError(
            f"trace arrays disagree: ids {trace.ids.shape}, valid {trace.valid.shape}, "
            f"kind {trace.kind.shape}, layers {trace.layers.shape}"
        )
    if not 0 < k <= trace.num_experts:
        raise UsageError(f"trace has k={k} picks per row but {trace.num_experts} experts")
    bad = set(trace.kind.tolist()) - set(KINDS)
    if bad:
        raise UsageError(f"trace step kinds {sorted(bad)} are not {' or '.join(KINDS)}")
    picked = trace.ids[np.broadcast_to(trace.valid[:, None, :, None], trace.ids.shape)]
    if picked.size and (picked.min() < 0 or picked.max() >= trace.num_experts):
        raise UsageError(f"trace expert ids outside 0..{trace.num_experts - 1}")
    return trace


def save_trace(path: str | Path, ids, valid, kind, layers, num_experts: int, model: str) -> Trace:
    """Checks and writes a trace (format in the module docstring); returns the checked `Trace`."""
    trace = validate(
        Trace(
            ids=np.asarray(ids, dtype=np.int32),
            valid=np.asarray(valid, dtype=bool),
            kind=np.asarray(kind, dtype=str),
            layers=np.asarray(layers, dtype=np.int32),
            num_experts=int(num_experts),
            model=str(model),
        )
    )
    stored = np.min_scalar_type(max(trace.num_experts - 1, 0))  # uint8 for 256 experts: 4x smaller
    try:
        with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz" to the name
            np.savez(  # uncompressed: compressing a 300-step trace takes longer than recording it
                f,
                ids=np.where(trace.valid[:, None, :, None], trace.ids, 0).astype(stored),
                valid=trace.valid,
                kind=trace.kind,
                layers=trace.layers,
                num_experts=np.int32(trace.num_experts),
                model=np.str_(trace.model),
            )
    except OSError as e:
        raise UsageError(f"cannot write trace {path}: {e.strerror}") from None
    return trace


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"trace {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            trace = Trace(
                ids=z["ids"].astype(np.int32),
                valid=z["valid"],
                kind=z["kind"],
                layers=z["layers"],
                num_experts=int(z["num_experts"]),
                model=str(z["model"]),
            )
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise UsageError(f"{path} is not a moejax trace: {str(e).splitlines()[0]}") from None
    return validate(trace)
