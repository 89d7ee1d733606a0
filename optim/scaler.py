"""Dynamic loss scaling for fp16 training (the rule of Megatron-LM's DynamicGradScaler).

The loss is multiplied by `scale` before backward and the gradients by 1/scale before the
update. After each step `update(found_inf)` adjusts the scale:

- overflow (any non-finite gradient on any rank; the step is skipped):
  growth_tracker <- 0; hysteresis_tracker <- hysteresis_tracker - 1;
  if hysteresis_tracker <= 0: scale <- max(scale * backoff_factor, min_scale).
  The hysteresis tracker is refilled only by growth, so the first `hysteresis - 1` overflows
  after a growth are tolerated and every later one backs off.
- clean step: growth_tracker <- growth_tracker + 1; when it reaches growth_interval:
  scale <- scale * growth_factor, growth_tracker <- 0, hysteresis_tracker <- hysteresis.

With hysteresis=1 this is torch.amp.GradScaler's rule (plus the min_scale floor).
"""

from __future__ import annotations

from typing import Any


class DynamicLossScaler:
    """Host-side dynamic loss scale; `scale` is a Python float (no device sync to read it)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        _validate(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Apply the module docstring's rule for one step."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """The scale and both trackers (Megatron's keys)."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from `state_dict()` (a 1-element tensor scale, as Megatron saves it, is accepted)."""
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd["growth_tracker"])
        self.hysteresis_tracker = int(sd["hysteresis_tracker"])


def _validate(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
) -> None:
    """Reject settings under which the rule is not a dynamic loss scale."""
    checks = [
        (0 < min_scale <= init_scale, f"min_scale={min_scale} must be in (0, init_scale={init_scale}]."),
        (growth_factor > 1, f"growth_factor={growth_factor} must be > 1."),
        (0 < backoff_factor < 1, f"backoff_factor={backoff_factor} must be in (0, 1)."),
        (growth_interval >= 1, f"growth_interval={growth_interval} must be >= 1."),
        (hysteresis >= 1, f"hysteresis={hysteresis} must be >= 1."),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
