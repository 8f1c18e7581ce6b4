"""The engine factory: devices, this host's layout, and the engines of a `Config` (one
placement, prefill and decode on placements of their own, or with the MTP draft module).
The verbs call it; it imports no verb."""

from __future__ import annotations

import dataclasses
import os

from moejax.base import platform
from moejax.base.errors import UsageError
from moejax.config import Config, ConfigError
from sharding import registry, rules
from sharding.mesh import make_mesh
from sharding.tensor_sliced import TensorSliced


def init_processes(args) -> None:
    """Multi-host: join the jax.distributed run, this process holding devices / processes of the
    devices (virtual CPU devices here, talking through gloo). Must run before jax starts."""
    n = getattr(args, "num_processes", 1)
    if n <= 1:
        return
    if not args.coordinator or not 0 <= args.process_id < n:
        raise UsageError(f"--num-processes {n} needs --coordinator HOST:PORT and --process-id in 0..{n - 1}")
    devices = args.devices or 8
    if devices % n:
        raise UsageError(f"--devices {devices} cannot be split over {n} processes")
    p, d = getattr(args, "prefill_devices", 0), getattr(args, "decode_devices", 0)
    if (p or d) and (p != d or p % n):
        # The hand-over copies shard for shard, each process's prefill devices to its own decode devices.
        raise UsageError(
            f"over {n} processes, --prefill-devices and --decode-devices must be equal and divide by {n}; "
            f"got {p} and {d}"
        )
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices // n}".strip()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=n, process_id=args.process_id)


def cpu_devices(n: int) -> None:
    """Ask XLA:CPU for `n` virtual devices, unless XLA_FLAGS already names a count; takes effect
    only before jax first touches a backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def ensure_devices(n: int) -> None:
    """On a CPU host, make `n` virtual devices; must run before jax first touches a backend."""
    cpu_devices(n)
    import jax

    have = len(jax.devices())
    if have < n:
        raise UsageError(f"--devices {n} asked for, but this machine has {have} {platform.resolve().name} devices")


def host_layout(config: Config) -> Config:
    """`config` with layout.devices 0 ("auto") resolved for this host. On a CPU host of several
    cores: one virtual device per core, and every weight sliced over them (tensor-sliced experts,
    tensor-parallel attention, vocab-parallel head). XLA:CPU runs one device's program on one core
    (its expert loop, which bounds decode, never gets a second thread), so a single device leaves
    the other cores idle; sliced evenly, every device reads its share of each weight, the memory
    traffic a decode step is bound by. Elsewhere: one device (a mesh of accelerators is a choice:
    --devices, --placement)."""
    if config.layout.devices:
        return config
    cores = platform.host_cores()
    cpu_devices(cores)
    import jax

    single = dataclasses.replace(config.layout, devices=1)
    if not platform.resolve().slices_over_cores:
        return dataclasses.replace(config, layout=single)
    # The most devices, up to one per core, that slice every expert evenly.
    for n in range(min(cores, len(jax.devices())), 1, -1):
        layout = dataclasses.replace(config.layout, placement=TensorSliced.name, devices=n, attention="tp", head="tp")
        try:
            rules.check_model(config.model, 1, n, config.weights.expert_format)
        except ConfigError:
            continue
        return dataclasses.replace(config, layout=layout)
    return dataclasses.replace(config, layout=single)


def build_engine(
    config: Config,
    hf_dir: str | None,
    seed: int,
    checkpoint: str | None = None,
    devices: list | None = None,
    params: dict | None = None,
    phy2log=None,
):
    """An engine of `config`'s placement on the machine's first devices, or on `devices`;
    `params`: another engine's, placed and arranged as this placement lays them out, experts in
    slots `phy2log` where the layout places them (else loaded and placed)."""
    # Deferred: orbax, safetensors and the model code load only for the verbs that run a model.
    from moejax.base.trace import load_trace
    from moejax.engine.engine import Engine
    from moejax.engine.expert_placement import place_experts
    from moejax.engine.routing import Routing
    from moejax.launch.loading import load_params, with_hf_model

    config = host_layout(with_hf_model(config, hf_dir, checkpoint)).validate()
    routing = Routing.parse(config.engine.routing, load_trace)
    routing.check(config.model)  # before loading weights: a mismatched trace fails fast
    ensure_devices(config.layout.devices)
    placement = registry.make_placement(config, devices=devices)
    if params is None:
        # Straight into the placement's loops: an unrolled run's layers never pass through a stack.
        params = load_params(config, placement, hf_dir=hf_dir, checkpoint=checkpoint, seed=seed, loops=placement.loops)
        params, phy2log = place_experts(params, placement, load_trace, placement.loops)
    return Engine(config, params, placement, routing, phy2log, arranged=True)


def pd_devices(args, shared: int) -> tuple[list, list]:
    """(prefill devices, decode devices) of the PD flags: split, or both the first `shared`."""
    from moejax.engine.disaggregated import split_devices

    p, d = args.prefill_devices, args.decode_devices
    if bool(p) != bool(d) or p < 0 or d < 0:
        raise UsageError(f"--prefill-devices and --decode-devices go together, both at least 1; got {p} and {d}")
    ensure_devices(p + d or shared)
    return split_devices(p, d, shared)


def pd_engine(config: Config, devices: list, name: str, args, others=()):
    """An engine of placement `name` on `devices`. Parameters are placed once per mesh: an
    engine of `others` on a mesh of the same devices and shape lays them out alike, and lends
    its own (two placements of one (ep, tp) shape differ only in their exchange)."""
    config = registry.with_placement(config, name, len(devices))
    mesh = make_mesh(registry.placement_class(name).mesh_shape(config.layout), devices)
    alike = [e for e in others if e.placement.mesh == mesh]
    return build_engine(
        config,
        args.hf,
        args.seed,
        args.checkpoint,
        devices=devices,
        params=alike[0].params if alike else None,
        phy2log=alike[0].phy2log if alike else None,
    )


def pd_engines(config: Config, args) -> tuple:
    """(prefill engine, decode engine) of the PD flags: --prefill/--decode-placement (default
    --placement) on their devices."""
    own = config.layout.placement or registry.DEFAULT
    prefill_devices, decode_devices = pd_devices(args, config.layout.devices)
    prefill = pd_engine(config, prefill_devices, args.prefill_placement or own, args)
    return prefill, pd_engine(config, decode_devices, args.decode_placement or own, args, others=[prefill])


def mtp_engine(engine, args, others=()):
    """`engine` with the model's MTP draft module (`--speculative mtp`), placed as its parameters;
    an engine of `others` with the same parameters lends its module."""
    from moejax.engine.speculative import SpeculativeEngine
    from moejax.launch.loading import load_mtp

    alike = [o for o in others if o.engine.params is engine.params]
    mtp = (
        alike[0].mtp
        if alike
        else load_mtp(
            engine.config,
            engine.placement,
            hf_dir=args.hf,
            checkpoint=getattr(args, "checkpoint", None),
            init=args.mtp_init,
            seed=args.seed,
        )
    )
    return SpeculativeEngine(engine, mtp)
