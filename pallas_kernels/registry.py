"""`grouped_gemm`: the one entry point; runs the backend it is named, with the platform's decisions it is handed."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp

from pallas_kernels import catalog, epilogue, formats, layered, linear_segments, probes, tiles, topk

# The backends are the catalog's grouped GEMMs (`catalog.GEMM`; "auto" is the caller's to resolve:
# `moejax.base.platform`): each record names its module and function, the platform's decisions it takes
# (`grouped_gemm`'s arguments of those names), and whether it runs interpreted.


def run_weights(w, expert_format: str, k_slices: int = 1, kernel: str = "auto", gated: bool = False):
    """Stacked experts w: [E, K, N] as the grouped GEMM takes them: in `expert_format` (a 4-bit
    format, quantized in `k_slices` K-slices; `gated`: N interleaves gate and up, each half
    with its own tensor scale; anything else leaves w as it is), converted once, at load, for a
    kernel that wants its own layout."""
    if expert_format not in formats.FORMATS:
        return w
    return for_kernel(formats.quantize_experts(w, expert_format, k_slices, gated), kernel)


def for_kernel(q: formats.QuantizedArray, kernel: str):
    """4-bit experts [..., E, K, N] in the layout `kernel` reads (converted once, at load)."""
    record = catalog.CATALOG.get((catalog.GEMM, kernel))  # None: "auto" (run_weights' default)
    if record is None or record.prepares is None:
        return q
    prepare = getattr(record.kernel_module(), record.prepares)
    for _ in range(q.ndim - 3):  # a run's stacked layers
        prepare = jax.vmap(prepare)
    return prepare(q)


def is_blackwell(device=None) -> bool:
    """Whether `device` (default: this machine's first) is an sm_100 GPU (B200 / B300)."""
    return probes.gpu_major(device or jax.devices()[0]) in catalog.gemm("blackwell").architectures


def backend_fn(name: str, gemm_rows=None, precision=None):
    """Backend `name`'s grouped GEMM, with those of the platform's decisions it takes (`grouped_gemm`)."""
    record = catalog.gemm(name)
    decisions = {"gemm_rows": gemm_rows, "precision": precision}
    interpret = {"interpret": True} if record.interpreted else {}
    return functools.partial(record.load(), **interpret, **{k: decisions[k] for k in record.takes})


def gemm_tiles(backend: str, rows: int, rhs, gated: bool = False, device: tuple[str, int] = ("", 0)):
    """The tiles (its module's `Tiles`) `backend`'s kernel takes for `rows` rows of rhs [G, K, N] (`gated`:
    its epilogue halves a gate|up product) on `device` (device kind, SMs), from the table under its
    record's key (`tiles.lookup`); None for a kernel that takes none."""
    record = catalog.gemm(backend)
    if record.tiles is None:
        return None
    stack = layered.stored(rhs)
    fmt = getattr(stack, "fmt", None) or ("f32" if stack.dtype == jnp.float32 else "bf16")
    block = formats.FORMATS[fmt].block if fmt in formats.FORMATS else 1
    _, k, n = rhs.shape
    chosen = tiles.lookup(record.tiles, device, rows=rows, k=k, n=n, fmt=fmt, gated=gated, block=block)
    return record.kernel_module().Tiles(**chosen)


@functools.partial(
    jax.jit, static_argnames=("backend", "preferred_element_type", "act", "gemm_rows", "precision", "device")
)
def grouped_gemm(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=0,
    backend: str = "xla",
    preferred_element_type=None,
    bias=None,
    act=None,
    lhs_rows=None,
    combine=None,
    gemm_rows=None,
    precision=None,
    device: tuple[str, int] = ("", 0),
):
    """out[r] = lhs[r] @ rhs[g(r) - group_offset] (+ bias[g(r) - group_offset]) for rows r of
    local groups, else 0; with `act`, rhs is a gate|up stack (gate and up interleaved along N)
    and out[r] = act(gate, up) of that product.

    lhs: [M, K], rows sorted by group. rhs: [G_local, K, N] array, or a QuantizedArray from
    `quantize(w, fmt, axis=-2)`, or either as one layer of a stack (`layered.LayerOf`).
    group_sizes: [G] int32 rows per group over all G groups,
    sum <= M. group_offset: scalar (may be traced): rhs[j] is global group group_offset + j.
    Rows of groups outside [group_offset, group_offset + G_local) and rows past
    sum(group_sizes) come out zero; groups without rows are never read. bias: [G_local, N].
    act: act(gate, up) -> [.., N/2] (hashable: static); the Pallas kernels apply it, with the
    bias and the column scales, in their epilogue and write [M, N/2] (`epilogue`).
    lhs_rows: [M] int32, lhs then [T, K]: row r of the product is lhs[lhs_rows[r]] (the XLA loop
    reads each chunk's rows through it; other kernels take lhs[lhs_rows] first).
    combine: (order [M], weights [T, k]), the product's rows the T tokens' M = T*k picks sorted by group
    (`order`: sorted row -> flat pick), without act: returns [T, N], each token's picks' rows
    weighted and summed (`epilogue.combine`; the XLA loop adds each chunk into its tokens' rows
    as it goes, in group order, and never writes the [M, N] product).
    backend: a kernel's name (a placement's `kernel`: "auto" resolved for its platform).
    gemm_rows: gemm_rows(M, 4-bit rhs) -> how the XLA path meets M rows, the platform's choice
    (`moejax.base.platform.Platform.gemm_rows`; None: its loop over the touched groups). precision:
    jax's matmul precision of the kernels' products (the run's: `Platform.matmul_precision`).
    device: (device kind, SMs) the kernel's tiles are looked up for (`gemm_tiles`; ("", 0): the rules).
    Returns [M, N] (with act: [M, N/2]) in preferred_element_type (default: lhs.dtype).
    """
    chex.assert_rank([lhs, group_sizes], [2, 1])
    chex.assert_type(group_sizes, jnp.int32)
    if len(rhs.shape) != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs must be [G, K={lhs.shape[1]}, N], got {rhs.shape}")
    if combine is not None and act is not None:
        raise ValueError("combine sums a down product's rows; a gate|up product (act) has none to sum")
    stack = layered.stored(rhs)
    if isinstance(stack, formats.QuantizedArray) and stack.axis != -2:
        raise ValueError("a 4-bit rhs must be quantized along K (axis=-2)")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    record = catalog.gemm(backend)
    kernel = backend_fn(backend, gemm_rows=gemm_rows, precision=precision)
    if lhs_rows is not None and "rows" not in record.reads:
        lhs, lhs_rows = lhs[lhs_rows], None
    rows = {} if lhs_rows is None else {"lhs_rows": lhs_rows}
    m, n = (lhs if lhs_rows is None else lhs_rows).shape[0], rhs.shape[2]
    # A placement hands a kernel that reads no layer out of its stack the layer as its own array.
    if "stack" not in record.reads and stack is not rhs:
        raise ValueError(f"the {backend} kernel reads a layer as its own [G, K, N], not as a view of its stack")

    def tiled(gated: bool = False):  # the kernel with its tiles for this call (a kernel without: as it is)
        chosen = gemm_tiles(backend, m, rhs, gated, device)
        return kernel if chosen is None else functools.partial(kernel, tiles=chosen)

    columns = None if record.scales_columns else _column_scales(rhs)
    if combine is not None and columns is None and _fuses(record, "fuses_combine", m, n, rhs):
        return tiled()(lhs, rhs, group_sizes, group_offset, out_dtype, combine=combine, bias=bias, **rows)
    if act is not None and _fuses(record, "fuses_glu", m, n, rhs):
        return tiled(gated=True)(
            lhs,
            _unit_scales(rhs) if columns is not None else rhs,
            group_sizes,
            group_offset,
            out_dtype,
            epilogue=(columns, bias, act),
            **rows,
        )
    if columns is None:
        out = tiled()(lhs, rhs, group_sizes, group_offset, out_dtype, **rows)
        scale = None
    else:  # column-wise tensor scales (a gate_up stack's two halves): the kernels scale per group,
        # so they run at scale 1 in f32 and each row takes its group's columns' scales after
        out = tiled()(lhs, _unit_scales(rhs), group_sizes, group_offset, jnp.float32, **rows)
        scale = epilogue.group_rows(columns, group_sizes, group_offset, m)
    return epilogue.finish_product(out, out_dtype, scale, bias, group_sizes, group_offset, act, combine)


def pick_gemm(
    lhs,
    rhs,
    ids,
    *,
    k: int,
    group_offset=0,
    backend: str,
    out_dtype,
    bias=None,
    act=None,
    rows_are_picks: bool = False,
    precision=None,
    device: tuple[str, int] = ("", 0),
):
    """A decode set's pick GEMM (`gmm_picks.pick_gemm`, `gmm_picks_mgpu.pick_gemm`) of the picks ids
    [P] (a [T, k] router's, flattened) with the tiles the decode table gives its shape on `device`
    (device kind, SMs: `tiles.py`): out [P, N] (with act: [P, N/2]) of each pick's row times its
    expert; picks of experts outside the local ones are zero. bias: [G_local, N]; act, precision: as
    `grouped_gemm`'s."""
    record = catalog.kernel(catalog.DECODE, backend)
    kernel = record.kernel_module()
    stack = layered.stored(rhs)
    if isinstance(stack, formats.QuantizedArray):
        fmt, tk_floor = stack.fmt, 2 * stack.spec.block
    else:
        fmt, tk_floor = ("f32" if stack.dtype == jnp.float32 else "bf16"), 16
    p, (g_local, kdim, n) = ids.shape[0], rhs.shape
    touched = min(g_local, p)  # experts a call can read: the programs that stream weights
    chosen = tiles.lookup(
        record.tiles,
        device,
        rows=kernel.table_rows(lhs.shape[0], p, k),
        k=kdim,
        n=n,
        fmt=fmt,
        gated=act is not None,
        programs=lambda tn, splits: touched * -(-n // tn),
        tn_floor=kernel.TN_FLOORS[act is not None],
    )
    chosen["tk"] = max(chosen["tk"], tk_floor)
    epilogue = None if bias is None and act is None else (None, bias, act)
    return record.load()(
        lhs,
        rhs,
        ids,
        k=k,
        group_offset=group_offset,
        out_dtype=out_dtype,
        epilogue=epilogue,
        rows_are_picks=rows_are_picks,
        tiles=kernel.Tiles(**chosen),
        precision=precision,
        interpret=record.interpreted,
    )


def expert_ffn(
    x,
    ids,
    weights,
    w: dict,
    *,
    group_offset=0,
    backend: str,
    act,
    down_bias=None,
    slot=None,
    precision=None,
    device: tuple[str, int] = ("", 0),
):
    """A decode set's experts as one call (its record's `whole_ffn`): x [T, D], ids and weights [T, k]
    -> [T, D], the sum of each row's picks' weight * down(act(gate, up)) through w's gate_up and down
    (and gate_up_bias) of the local experts, with the tiles the table gives their shape on `device`;
    slot [G_local]: the picks' table of which expert's tiles each step reads, where the router kernel
    wrote it (else the kernel's caller builds it from ids)."""
    record = catalog.kernel(catalog.DECODE, backend)
    kernel = record.kernel_module()
    _, k, n = w["gate_up"].shape
    chosen = tiles.lookup(record.tiles, device, rows=x.shape[0], k=k, n=n, gated=True)
    return record.load()(
        x,
        ids,
        weights,
        w["gate_up"],
        w["down"],
        group_offset=group_offset,
        act=act,
        gate_up_bias=w.get("gate_up_bias"),
        down_bias=down_bias,
        slot=slot,
        tiles=kernel.Tiles(**chosen),
        precision=precision,
        interpret=record.interpreted,
    )


def route(x, norm, router, *, backend: str, k: int, eps: float, scoring: str, bias=None, device=("", 0), **weighing):
    """A decode set's router as one call (its record's `router`): x [T, D], the MoE's norm [D], router
    [D, E] f32 -> (h [T, D] normed, ids [T, k] int32, weights [T, k] f32, slot [E] int32: the set's
    experts kernel's table of the picks, `expert_ffn`'s slot, or None where `slots` is False or the set
    has none), with the tiles the table gives its shape on `device` where it takes tiles: its experts
    in chunks, then split over D, until its programs fill the SMs. weighing: norm_topk_prob,
    routed_scaling_factor, precision, slots."""
    record = catalog.kernel(catalog.DECODE, backend)
    chosen = {}
    if record.tiles is not None:
        kernel = record.kernel_module()
        (m, d), e = x.shape, router.shape[-1]
        found = tiles.lookup(
            record.tiles,
            device,
            rows=m,
            k=d,
            n=e,
            fmt="f32",
            # a program's experts narrow first (chunks add no partials for the combine to sum), then D splits
            programs=lambda chunk, splits: splits * (e // chunk) * -(-m // kernel.ROWS),
            tn_floor=kernel.e_floor(e),
            n_field="e",
            tk_floor=kernel.K_FLOOR,
            k_field="k",
            max_splits=max(1, min(d // kernel.K_FLOOR, kernel.PARTIAL_BYTES // (4 * e))),
        )
        chosen = {"tiles": kernel.Tiles(**found)}
    return record.load()(
        x, norm, router, k=k, eps=eps, scoring=scoring, bias=bias, interpret=record.interpreted, **chosen, **weighing
    )


def fused_linear(x, weights, *, backend: str, device: tuple[str, int] = ("", 0), programs, **kw):
    """A decode set's dense kernel (its record's `dense`, named `backend`): `fused_linear` of rows
    x [M, K] and weight segments [K, N_i] with the tiles the table gives the call's shape on `device`,
    narrowed or split over K until they fill its SMs (`tiles.lookup`; `programs(tn, splits)`: the
    call's programs at N tile tn and K in `splits` slices). kw: `fused_linear`'s other arguments."""
    record = catalog.kernel(catalog.DECODE, backend)
    kernel = record.kernel_module()
    m, k = x.shape[0], math.prod(x.shape[1:])  # a TPU's rows may be of heads [M, H, Dh] (its kernel's contract)
    # A TPU's segments may come in their model's shape ([K, H, Dh], [H, Dh, N]) and in their stack (`layered.LayerOf`).
    dtype = layered.stored(weights[0]).dtype
    itemsize = dtype.itemsize
    chosen = tiles.lookup(
        record.tiles,
        device,
        rows=m,
        k=k,
        n=sum(
            linear_segments.columns(w, k) if window is None else window[1] - window[0]
            for w, window in zip(weights, kw.get("windows") or [None] * len(weights))
        ),
        fmt="f32" if dtype == jnp.float32 else "bf16",
        gated=kw.get("act") is not None,
        programs=programs,
        # The N tile narrows to 128 bytes of a weight row (a memory transaction), no slivers; past that K splits.
        tn_floor=128 // itemsize,
        n_field="n",
        tk_floor=kernel.K_FLOOR,
        k_field="k",
        # The slices' f32 partials, written and read back (8 bytes a row and column a slice), at most
        # an eighth of the weight's bytes: splits at batch 1, few or none at 64 rows.
        max_splits=max(1, k * itemsize // (64 * m)),
    )
    return record.load()(x, weights, tiles=kernel.Tiles(**chosen), interpret=record.interpreted, **kw)


def topk_route(logits, k: int, *, backend: str | None, device: tuple[str, int] = ("", 0), **kw):
    """A decode set's top-k after the router's product (its record's `topk`, named `backend`; None:
    XLA's ops): logits [M, E] f32 -> (ids [M, k] int32, weights [M, k] f32). kw: scoring, bias,
    norm_topk_prob, routed_scaling_factor."""
    if backend is None:
        return topk.topk_route_xla(logits, k, **kw)
    record = catalog.kernel(catalog.DECODE, backend)
    chosen = tiles.lookup(record.tiles, device)
    return record.load()(logits, k, tiles=record.kernel_module().Tiles(**chosen), interpret=record.interpreted, **kw)


def _fuses(record: catalog.Kernel, probe: str, m: int, n: int, rhs) -> bool:
    """Whether `record`'s kernel does a step itself for m rows of rhs (N columns), by its module's
    `probe`: fuses_glu (the gated activation of a gate|up stack), fuses_combine (the sum of each
    token's picks)."""
    fuses = getattr(record.kernel_module(), probe, None)
    return bool(fuses and fuses(m, n, rhs))


def _unit_scales(rhs):
    """rhs (or a LayerOf's stack) with its tensor scales taken out (applied by the epilogue, column-wise)."""
    if isinstance(rhs, layered.LayerOf):
        return rhs.replace(stack=_unit_scales(rhs.stack))
    unit = None if isinstance(rhs, formats.QuantizedArray) else jnp.ones(rhs.tensor_scale.shape[:1], jnp.float32)
    return rhs.replace(tensor_scale=unit)


def _column_scales(rhs) -> jax.Array | None:
    """[G, N] column-wise tensor scales of a 4-bit rhs ([G, 1, N], or Blackwell's [G, N]; a
    LayerOf's: its layer's); None where there is one scale per group (or none)."""
    stack = layered.stored(rhs)
    ts = getattr(stack, "tensor_scale", None)
    if ts is None or (ts.ndim == 1 if not isinstance(stack, formats.QuantizedArray) else ts.shape[-1] == 1):
        return None
    if isinstance(rhs, layered.LayerOf):
        ts = layered.layer_slice(ts, rhs.index)
    return ts.reshape(ts.shape[0], -1)
