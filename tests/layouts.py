"""Every registered placement as a test layout: a new placement gets coverage in each test that
reads this, with no table to extend."""

from moejax.config import LayoutConfig
from sharding import names


def placement_layouts(devices: int = 8, **own_devices: int) -> dict[str, LayoutConfig]:
    """Each registered placement on `devices` devices, on the mesh it picks there (hybrid: 4 x 2
    on 8); `own_devices`: a placement's own device count, by name."""
    return {name: LayoutConfig(placement=name, devices=own_devices.get(name, devices)) for name in names()}
