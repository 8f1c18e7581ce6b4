"""GLM-5.3's predicted decode step per placement on 8 B200 and 8 B300 (`plan --target`'s priced
layer, `moejax/analysis/layer_ops.py`) beside Row-Meets-Experts' measured SGLang steps
(docs/references.md), as docs/placements.md's table.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/placement_pricing.py [--batches 8 64 256] [--placements ...]

One B200 program per placement and batch (the steps of 3 and 4 layers, compile-only devices), priced
on the B200 and on the B300 (compiled as a B200: the same HLO). The study's load: DP attention,
NVFP4 experts, 1,000 prompt and 150 new tokens a request (--context 1152). Prints a markdown row per
placement and batch as it is done (compile seconds to stderr): about 10 to 90 s a row on two
CPU cores, 8 minutes in all.
"""

from __future__ import annotations

import argparse
import sys
import time

from moejax.analysis import layer_ops
from moejax.base import targets
from moejax.compiled import plan
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from sharding import names, with_placement

# Row-Meets-Experts §5.3, GLM-5.3 NVFP4 on 8 B300 under SGLang, DP attention, median inter-token ms
# at 8, 64 and 256 concurrent requests, by the placement its configuration is ("" where it ran none
# or gave no figure): slices (configuration 1), whole experts with the row on every GPU (2),
# traveling rows (5, 4-bit; configuration 4's 16-bit rows 21.7 at 256).
STUDY = {
    "tensor_sliced": {8: "13.4", 64: "19.3", 256: "24.2"},
    "expert_sharded": {8: "13.4-14.2 (all five)", 64: "18.5-19.7 (all five)", 256: "26.7"},
    "ragged_a2a": {8: "13.5-13.7 (1-2% over slices)", 64: "18.5", 256: "21.6"},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="glm-5.3")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--placements", nargs="+", default=list(names()), choices=names())
    parser.add_argument("--context", type=int, default=1152)
    parser.add_argument("--page-size", type=int, default=plan.PAGE_SIZE)
    args = parser.parse_args(argv)

    model = preset(args.preset)
    devices = list(targets.devices("b200", 8))
    priced = [targets.target("b200"), targets.target("b300")]
    base = Config(
        model=model,
        layout=LayoutConfig(devices=8, attention="dp"),
        weights=WeightsConfig("nvfp4"),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()
    print(
        "| requests | placement | ep x tp | kernel | kernels | collectives | MB a layer | "
        + " | ".join(f"{t.name} step ms (attention / experts / exchange / rest, us a layer)" for t in priced)
        + " | SGLang on 8 B300, ms |"
    )
    print("|---" * (8 + len(priced)) + "|", flush=True)
    for batch in args.batches:
        for name in args.placements:
            config = with_placement(base, name, 8)
            placement = plan.programs(config, batch, args.context, batch, "cuda", devices, args.page_size)[0]
            start = time.perf_counter()
            texts = layer_ops.depth_programs(config, batch, args.context, "cuda", devices, args.page_size)
            seconds = time.perf_counter() - start
            head = f"| {batch} | `{name}` | {placement.ep} x {placement.tp} | {placement.kernel} |"
            study = STUDY.get(name, {}).get(batch, "") if args.preset == "glm-5.3" else ""  # the study's model only
            if isinstance(texts, str):
                reason = texts.splitlines()[0] if texts else "no reason given"
                print(f"{head} does not compile: {reason} | | | | | {study} |", flush=True)
                continue
            layers = [layer_ops.layer_of(model.num_layers, texts, t, len(devices))["predicted"] for t in priced]
            p = layers[0]
            cells = []
            for q in layers:
                split = " / ".join(
                    f"{q['layer_parts_us'][c]:.0f}" for c in ("attention", "experts", "exchange", "rest")
                )
                cells.append(f"{q['step_ms']:.1f} ({split})")
            print(
                f"{head} {p['kernels']:g} | {p['collectives']:g} | {p['layer_bytes'] / 1e6:.0f} | "
                + " | ".join(cells)
                + f" | {study} |",
                flush=True,
            )
            print(f"{name} at {batch}: the two depths compiled in {seconds:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
