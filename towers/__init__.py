"""In-graph multi-GPU data parallelism for TensorFlow 1.x-style graphs."""

from towers._accumulate import accumulate_gradients
from towers._apply import apply_gradients
from towers._batch_norm import batch_normalization
from towers._broadcast import broadcast_variables
from towers._context import tower_context
from towers._context import TowerContext
from towers._devices import tower_devices
from towers._devices import virtual_cpu_config
from towers._gradients import average_gradients
from towers._gradients import GradsAndVars
from towers._infer import infer
from towers._build import build_towers
from towers._build import Towers
from towers._train import minimize

__version__ = "0.1.0"

__all__ = [
    "GradsAndVars",
    "TowerContext",
    "Towers",
    "accumulate_gradients",
    "apply_gradients",
    "average_gradients",
    "batch_normalization",
    "broadcast_variables",
    "build_towers",
    "infer",
    "minimize",
    "tower_context",
    "tower_devices",
    "virtual_cpu_config",
]
