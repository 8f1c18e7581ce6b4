"""The checkpoint directory: a manifest (`moejax.json`) naming one committed data directory.

    CKPT/moejax.json        format version, model config, storage dtype, expert format, groups,
                            size and CRC-32 of every file of the data directory
    CKPT/data-<id>/<g>/     one orbax checkpoint per group of parameters

A save writes a new `data-<id>` and then replaces `moejax.json` with one `os.replace`: that
rename is the commit. A save killed before it leaves the previous manifest and the data it
names untouched; the new, unreferenced data directory is what the next run reports (and the
next save removes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

from moejax.base.errors import UsageError
from moejax.config import OLD_EXPERT_FORMAT_NAMES, ConfigError, ModelConfig, replace_checked

# 2: a run of identical layers is stored stacked, as the layer scan reads it (1: layer by layer).
# 3: gate and up stored as one gate_up matrix (2 kept them apart; still read, `legacy.py`).
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
MANIFEST = "moejax.json"


@dataclasses.dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    dtype: str  # storage dtype of everything but the float32 router
    expert_format: str  # moejax.vocab.EXPERT_FORMATS (unquantized: stored as `dtype`)
    data: str = ""  # the committed data directory, relative to the checkpoint
    groups: tuple[tuple[str, ...], ...] = ()  # parameter keys of each orbax checkpoint, in order
    # data file (relative to `data`) -> (size, crc32): orbax stores no checksums, and a flipped
    # byte in a chunk would otherwise load as silently wrong weights.
    files: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION  # the format the data is stored in (a save writes this moejax's)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": self.version,
                "model": dataclasses.asdict(self.model),
                "dtype": self.dtype,
                "expert_format": self.expert_format,
                "data": self.data,
                "groups": [list(g) for g in self.groups],
                "files": self.files,
            },
            indent=1,
        )


def read_manifest(ckpt: str | Path) -> Manifest:
    """The committed manifest; one clear error naming the file otherwise."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST
    if not ckpt.is_dir():
        raise UsageError(f"{ckpt}: no such checkpoint directory")
    if not path.is_file():
        left = leftovers(ckpt, None)
        why = f" (an interrupted save left {left[0].name})" if left else ""
        raise UsageError(f"{ckpt}: not a moejax checkpoint, {MANIFEST} is missing{why}")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}: corrupted (not valid JSON)") from None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if version not in READ_VERSIONS:
        again = "; convert it again from its transformers directory" if version == 1 else ""
        older = ", ".join(str(v) for v in READ_VERSIONS if v != FORMAT_VERSION)
        raise UsageError(
            f"{path}: checkpoint format version {version}, this moejax reads version {FORMAT_VERSION} "
            f"(or {older}){again}"
        )
    try:
        manifest = Manifest(
            model=replace_checked(ModelConfig(), doc["model"], "model."),
            dtype=doc["dtype"],
            data=doc["data"],
            expert_format=OLD_EXPERT_FORMAT_NAMES.get(doc["expert_format"], doc["expert_format"]),
            groups=tuple(tuple(g) for g in doc["groups"]),
            files={k: (int(n), int(c)) for k, (n, c) in doc["files"].items()},
            version=version,
        )
        manifest.model.validate()
    except ConfigError as e:  # before ValueError, which it is
        raise UsageError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path}: corrupted (missing or malformed entry {e})") from None
    if not (ckpt / manifest.data).is_dir():
        raise UsageError(f"{path}: names data directory {manifest.data}, which is missing")
    return manifest


def leftovers(ckpt: Path, committed: str | None) -> list[Path]:
    """Data directories no manifest names: what interrupted saves left behind."""
    return sorted(p for p in ckpt.glob("data-*") if p.name != committed)


def warn_leftovers(ckpt: Path, committed: str) -> None:
    for p in leftovers(ckpt, committed):
        print(
            f"moejax: warning: {p} is left from an interrupted save; using the last complete save ({committed})",
            file=sys.stderr,
        )


@contextlib.contextmanager
def new_data_dir(ckpt: Path) -> Iterator[tuple[Path, str | None]]:
    """A fresh data directory for a save into `ckpt`, and the data directory committed now.

    Refuses a non-empty directory that is not a checkpoint (never overwrite a user's files).
    A save that fails with an error (not a kill) takes its partial data, and a checkpoint
    directory it created, away with it."""
    if ckpt.exists() and not ckpt.is_dir():
        raise UsageError(f"{ckpt}: exists and is not a directory")
    created = not ckpt.exists()
    try:
        ckpt.mkdir(parents=True, exist_ok=True)
        probe = ckpt / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{ckpt}: cannot write there ({e.strerror})") from None
    committed = None
    if (ckpt / MANIFEST).is_file():
        committed = read_manifest(ckpt).data
    elif any(p for p in ckpt.iterdir() if not p.name.startswith("data-")):
        raise UsageError(f"{ckpt}: exists and is not a moejax checkpoint; not writing into it")
    for p in leftovers(ckpt, committed):
        print(f"moejax: removing {p}, left from an interrupted save", file=sys.stderr)
        shutil.rmtree(p)
    data = ckpt / f"data-{uuid.uuid4().hex[:12]}"
    data.mkdir()
    try:
        yield data, committed
    except BaseException:
        shutil.rmtree(data, ignore_errors=True)
        if created:
            shutil.rmtree(ckpt, ignore_errors=True)
        raise


def commit(ckpt: Path, manifest: Manifest, previous: str | None) -> None:
    """Atomically points the checkpoint at `manifest.data`, then drops the previous data."""
    tmp = ckpt / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    fd = os.open(ckpt, os.O_RDONLY)  # the rename itself durable, not only ordered
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if previous:
        shutil.rmtree(ckpt / previous, ignore_errors=True)


def file_sums(data: Path, sub: str) -> dict[str, tuple[int, int]]:
    """(size, CRC-32) of every file under `data/sub`, keyed by path relative to `data`."""
    out = {}
    for path in sorted(p for p in (data / sub).rglob("*") if p.is_file()):
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
        out[str(path.relative_to(data))] = (path.stat().st_size, crc)
    return out


def verify_files(ckpt: Path, manifest: Manifest, sub: str) -> None:
    """Every file of `sub` present, whole and unchanged since the save; names the first that is not."""
    data = ckpt / manifest.data
    want = {k: v for k, v in manifest.files.items() if k.startswith(sub + "/")}
    have = file_sums(data, sub)
    for name, (size, crc) in want.items():
        if name not in have:
            raise UsageError(f"{data / name}: missing (the checkpoint is incomplete)")
        if have[name][0] != size:
            raise UsageError(f"{data / name}: truncated or overwritten ({have[name][0]} bytes, saved with {size})")
        if have[name][1] != crc:
            raise UsageError(f"{data / name}: corrupted (checksum differs from the one saved)")
