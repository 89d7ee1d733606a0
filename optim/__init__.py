"""zero3d's distributed optimizer: `ZeroOptimizer` (ZeRO stages 0-3) and its parts."""

from optim.scaler import DynamicLossScaler
from optim.zero import ZeroOptimizer

__all__ = ["DynamicLossScaler", "ZeroOptimizer"]
