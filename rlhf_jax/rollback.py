"""When a run rolls back (`trainer.rollback.*`): checks of one step's metrics, no arrays.

A step triggers a rollback when
- a loss or gradient norm of the actor or critic is NaN or infinite,
- the KL between actor and reference exceeds `max_kl` (the KL in the reward,
  `actor/reward_kl_penalty`, or the KL loss, `actor/kl_loss`), or
- `critic/vf_loss` spikes: once `warmup` good steps are in the window of the last `window`
  good steps' value losses, a step whose loss is at once
    above `value_loss_floor` (an absolute floor: a value loss of 0.002 is no fault, whatever
      the history; with 0/1 rewards the default 0.1 is a typical error of ~0.45),
    above `value_loss_spike` x the window's median, and
    above median + `value_loss_mads` x 1.4826 x MAD (the median absolute deviation, scaled
      to a normal's standard deviation: a jump far outside the window's own noise).
  Median and MAD ignore a single odd step in the window, which a running mean does not.

The watch's state is a small JSON dict, saved in every checkpoint and restored with it, so
a resumed run and a rolled-back run judge later steps exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from rlhf_jax.errors import UserError

NON_FINITE_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/vf_loss",
                   "critic/grad_norm")
KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss")
# Measured on the step's rollout, i.e. of the policy the step started from: the previous
# step's checkpoint holds that very policy, so a rollback goes one checkpoint further back.
ENTERING_KEYS = ("actor/reward_kl_penalty",)
MAD_TO_STD = 1.4826  # MAD x this = the standard deviation, for normal noise


class RollbackLimit(UserError):
    """More rollbacks than `trainer.rollback.max_rollbacks`: the run stops."""


@dataclasses.dataclass
class RollbackWatch:
    """The triggers of `trainer.rollback`, and the window of recent good value losses.

    Args:
      max_kl: largest KL to the reference a step may show.
      value_loss_spike: largest ratio of a step's value loss to the window's median.
      value_loss_floor: a value loss at or below this is never a spike.
      value_loss_mads: a spike is also this many (scaled) MADs above the median.
      window: good steps the median and MAD are taken over.
      warmup: good steps the window needs before the spike check applies.
    """

    max_kl: float
    value_loss_spike: float
    value_loss_floor: float = 0.1
    value_loss_mads: float = 6.0
    window: int = 20
    warmup: int = 3
    vf_window: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def from_config(cls, rb) -> RollbackWatch:
        """From `trainer.rollback` (a `RollbackConfig`)."""
        return cls(rb.max_kl, rb.value_loss_spike, rb.value_loss_floor, rb.value_loss_mads,
                   rb.window, rb.warmup_steps)

    def cause(self, metrics: Mapping[str, float]) -> str | None:
        """Why this step's metrics call for a rollback, in one line; None when they do not."""
        for key in NON_FINITE_KEYS:
            if key in metrics and not math.isfinite(metrics[key]):
                return f"non-finite {key} ({metrics[key]})"
        for key in KL_KEYS:
            if key in metrics and metrics[key] > self.max_kl:
                return f"{key} {metrics[key]:.4g} > max_kl {self.max_kl:g}"
        vf = metrics.get("critic/vf_loss")
        if vf is None or len(self.vf_window) < self.warmup or vf <= self.value_loss_floor:
            return None
        median = float(np.median(self.vf_window))
        mad = float(np.median(np.abs(np.asarray(self.vf_window) - median)))
        bound = max(self.value_loss_spike * median,
                    median + self.value_loss_mads * MAD_TO_STD * mad)
        if vf > bound:
            return (f"critic/vf_loss {vf:.4g} > {bound:.4g} (floor {self.value_loss_floor:g}; "
                    f"{self.value_loss_spike:g} x median {median:.4g}; median + "
                    f"{self.value_loss_mads:g} x 1.4826 x MAD {mad:.4g}, last "
                    f"{len(self.vf_window)} good steps)")
        return None

    def newest_restorable(self, step: int, metrics: Mapping[str, float]) -> int:
        """The newest checkpoint step a rollback of `step` may restore: `step - 2` when the
        cause is in the policy `step` started from (`ENTERING_KEYS`), else `step - 1`."""
        entering = any(k in metrics and metrics[k] > self.max_kl for k in ENTERING_KEYS)
        return max(step - 2 if entering else step - 1, 0)

    def observe(self, metrics: Mapping[str, float]) -> None:
        """Takes a good step's value loss into the window."""
        vf = metrics.get("critic/vf_loss")
        if vf is not None:
            self.vf_window = [*self.vf_window, float(vf)][-self.window:]

    def state(self) -> dict:
        return {"vf_window": list(self.vf_window)}

    def load(self, state: Mapping) -> None:
        self.vf_window = [float(v) for v in state["vf_window"]][-self.window:]
