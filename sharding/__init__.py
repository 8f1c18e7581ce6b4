"""Expert placements: one class per placement (its mesh shape, logical-axis rules, exchange,
bytes accounting and simulator cost hooks), listed once in `registry.py`.

The model calls only the `Placement` interface (`placement.py`); which placement runs is
chosen by `make_placement(config)`.
"""

from sharding.placement import Placement
from sharding.registry import make_placement, names, placement_class, with_placement

__all__ = ["Placement", "make_placement", "names", "placement_class", "with_placement"]
