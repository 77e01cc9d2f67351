"""Testing a model on towers: one call proves it trains as on one device.

`assert_matches_one_device` builds a model's one-device program and its
towers program, runs both from the same values on the same batch on virtual
CPU devices, and fails with a table of the values that part, and their
likely cause. ``import towers`` does not import this package.
"""

from towers.testing._matches import assert_matches_one_device

__all__ = ["assert_matches_one_device"]
