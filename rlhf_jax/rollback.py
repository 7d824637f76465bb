"""When a run rolls back (`trainer.rollback.*`): checks of one step's metrics, no arrays.

A step triggers a rollback when
- a loss or gradient norm of the actor or critic is NaN or infinite,
- the KL between actor and reference exceeds `max_kl` (the KL in the reward,
  `actor/reward_kl_penalty`, or the KL loss, `actor/kl_loss`), or
- `critic/vf_loss` exceeds `value_loss_spike` times its running mean (an exponential mean
  over the good steps so far, consulted once it holds `warmup` steps and is above 0).

The watch's state is a small JSON dict, saved in every checkpoint and restored with it, so
a resumed run and a rolled-back run judge later steps exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rlhf_jax.errors import UserError

NON_FINITE_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/vf_loss",
                   "critic/grad_norm")
KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss")


class RollbackLimit(UserError):
    """More rollbacks than `trainer.rollback.max_rollbacks`: the run stops."""


@dataclasses.dataclass
class RollbackWatch:
    """The triggers of `trainer.rollback`, and the running mean of the value loss.

    Args:
      max_kl: largest KL to the reference a step may show.
      value_loss_spike: largest ratio of a step's value loss to its running mean.
      decay: weight of the past in the running mean.
      warmup: good steps the running mean needs before the spike check applies.
    """

    max_kl: float
    value_loss_spike: float
    decay: float = 0.9
    warmup: int = 3
    vf_mean: float | None = None
    vf_steps: int = 0

    def cause(self, metrics: Mapping[str, float]) -> str | None:
        """Why this step's metrics call for a rollback, in one line; None when they do not."""
        for key in NON_FINITE_KEYS:
            if key in metrics and not math.isfinite(metrics[key]):
                return f"non-finite {key} ({metrics[key]})"
        for key in KL_KEYS:
            if key in metrics and metrics[key] > self.max_kl:
                return f"{key} {metrics[key]:.4g} > max_kl {self.max_kl:g}"
        vf = metrics.get("critic/vf_loss")
        if vf is not None and self.vf_steps >= self.warmup and self.vf_mean > 0 \
                and vf > self.value_loss_spike * self.vf_mean:
            return (f"critic/vf_loss {vf:.4g} > {self.value_loss_spike:g} x its running mean "
                    f"{self.vf_mean:.4g}")
        return None

    def observe(self, metrics: Mapping[str, float]) -> None:
        """Takes a good step's value loss into the running mean."""
        vf = metrics.get("critic/vf_loss")
        if vf is None:
            return
        self.vf_mean = vf if self.vf_mean is None else \
            self.decay * self.vf_mean + (1 - self.decay) * vf
        self.vf_steps += 1

    def state(self) -> dict:
        return {"vf_mean": self.vf_mean, "vf_steps": self.vf_steps}

    def load(self, state: Mapping) -> None:
        self.vf_mean, self.vf_steps = state["vf_mean"], int(state["vf_steps"])
