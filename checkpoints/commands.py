"""The `convert` verb (registered by moejax.cli)."""

from __future__ import annotations

import json

from moejax.vocab import DTYPES, EXPERT_FORMATS


def cmd_convert(args) -> int:
    from checkpoints.convert import convert

    manifest = convert(args.hf, args.out, expert_format=args.expert_format, dtype=args.dtype, progress=not args.json)
    summary = {
        "checkpoint": str(args.out),
        "family": manifest.model.family,
        "dtype": manifest.dtype,
        "expert_format": manifest.expert_format,
        "tensors": sum(map(len, manifest.groups)),
        "groups": len(manifest.groups),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"wrote {args.out}: {summary['tensors']} tensors in {summary['groups']} groups "
            f"({manifest.model.family}, {manifest.dtype}, experts {manifest.expert_format})"
        )
    return 0


def register(sub) -> None:
    c = sub.add_parser("convert", help="transformers safetensors directory -> orbax checkpoint")
    c.add_argument("--hf", metavar="DIR", required=True, help="a transformers save_pretrained directory")
    c.add_argument("--out", metavar="CKPT", required=True, help="checkpoint directory (replaced atomically)")
    c.add_argument(
        "--expert-format",
        choices=EXPERT_FORMATS,
        default="unquantized",
        help="experts in --dtype, or 4-bit: nvfp4 | mxfp4",
    )
    c.add_argument("--dtype", choices=DTYPES, default="float32", help="storage dtype of the other weights")
    c.add_argument("--json", action="store_true", help="machine-readable output, no progress bar")
    c.set_defaults(func=cmd_convert)
