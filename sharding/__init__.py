"""Expert placements: meshes from config, logical-axis rules per placement, exchange algorithms.

The model calls only the `Placement` interface (`placement.py`); which placement runs is
chosen by `make_placement(config)`.
"""

from sharding.placement import Placement, make_placement

__all__ = ["Placement", "make_placement"]
