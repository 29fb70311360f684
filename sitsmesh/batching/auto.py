"""When automatic mode re-tunes a model's batching: a pure policy with an injected clock.

The curve splits arrival rates into regions, one per measured batch size: region k
is where the rate needs batches of the k-th size (it passes what smaller batches
serve at TARGET_LOAD). A re-tune happens when the rate stays in another region than
the one the config was chosen for longer than the hold time, at most once per
cool-down, and never while the stage is overloaded (a reload adds work, and the
rate measured while shedding is not the offered one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sitsmesh.batching.curve import Curve, InvalidCurve

AUTO_KIND = "batching-auto"
TARGET_LOAD = 0.7
HOLD_S = 30.0
COOLDOWN_S = 300.0


@dataclass(frozen=True, slots=True)
class AutoSettings:
    pipeline: str
    enabled: bool = False
    hold_s: float = HOLD_S
    cooldown_s: float = COOLDOWN_S

    def validate(self) -> None:
        for name, value, low in (("hold_s", self.hold_s, 1.0),
                                 ("cooldown_s", self.cooldown_s, 10.0)):
            if math.isnan(value) or not low <= value <= 86_400:
                raise InvalidCurve(f"{name} must be {low:g}-86400 seconds, got {value}")

    def to_body(self) -> dict[str, object]:
        return {"pipeline": self.pipeline, "enabled": self.enabled, "hold_s": self.hold_s,
                "cooldown_s": self.cooldown_s}


def region(curve: Curve, rate: float) -> int:
    """Which measured batch size the rate needs (0: the smallest serves it)."""
    for index, point in enumerate(curve.points):
        if rate <= TARGET_LOAD * curve.capacity(point.batch_size):
            return index
    return len(curve.points) - 1


@dataclass(slots=True)
class _Model:
    applied: int | None = None       # the region the config in force was chosen for
    candidate: int | None = None
    since: float = 0.0
    last_change: float = -math.inf


@dataclass(slots=True)
class AutoPolicy:
    models: dict[str, _Model] = field(default_factory=dict)

    def due(self, model: str, curve: Curve, rate: float, *, overloaded: bool, now: float,
            settings: AutoSettings) -> bool:
        """True when the model should be re-tuned now; the caller then calls `tuned`."""
        state = self.models.setdefault(model, _Model())
        if overloaded or rate <= 0:
            state.candidate = None
            return False
        here = region(curve, rate)
        if state.applied is None:
            # First look after a start: take the config in force as chosen for here.
            state.applied = here
        if here == state.applied:
            state.candidate = None
            return False
        if state.candidate != here:
            state.candidate, state.since = here, now
            return False
        if now - state.since < settings.hold_s:
            return False
        return now - state.last_change >= settings.cooldown_s

    def tuned(self, model: str, curve: Curve, rate: float, now: float) -> None:
        """A re-tune ran (whatever its outcome): the cool-down starts, the region is
        taken, so a failing change is not retried every tick."""
        state = self.models.setdefault(model, _Model())
        state.applied = region(curve, rate)
        state.candidate = None
        state.last_change = now
