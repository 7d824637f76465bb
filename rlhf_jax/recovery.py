"""Checkpoints, resume and rollback of a `Trainer` run (`trainer.resume_mode`, `trainer.rollback`).

`Recovery` is the `Trainer`'s base: its methods save and restore what a run's future
depends on: the actor, critic and reference states (arrays, through orbax), plus the step,
data-loader position, KL coefficient, rollback watch and recent scores (metadata). They use
the trainer's `cfg`, `checkpointer`, `train_loader`, `kl_state`, `watch`, `recent_scores`,
`rollbacks`, `global_step`, `log` and `sync_weights`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from rlhf_jax.checkpoint import Checkpointer, CheckpointError
from rlhf_jax.config import to_dict
from rlhf_jax.core_algos import KLControllerState
from rlhf_jax.rollback import RollbackLimit


class Recovery:
    """Checkpoint save / restore / roll back, mixed into `Trainer`."""

    def _ckpt_state(self) -> dict:
        """Every array a run's future depends on (the rest goes in `_ckpt_meta`)."""
        state = {"actor": self.actor}
        if self.critic is not None:
            state["critic"] = self.critic
        if self.ref_params is not None:
            state["ref"] = self.ref_params
        return state

    def _ckpt_meta(self) -> dict:
        return {
            "good": True, "step": self.global_step, "epoch": self.train_loader.epoch,
            "loader": self.train_loader.get_state(),
            "kl_coef": float(self.kl_state.kl_coef), "watch": self.watch.state(),
            "recent_scores": self.recent_scores, "config": to_dict(self.cfg),
        }

    def save(self) -> None:
        """Starts an asynchronous checkpoint of this step (`checkpoints/<step>`)."""
        self.checkpointer.save(self.global_step, self._ckpt_state(), self._ckpt_meta(),
                               force=True)

    def _load(self, step: int, state: dict, meta: dict) -> None:
        self.actor = state["actor"]
        self.critic = state.get("critic", self.critic)
        self.ref_params = state.get("ref", self.ref_params)
        self.global_step = step
        self.train_loader.set_state(meta["loader"])
        self.kl_state = KLControllerState(jax.numpy.asarray(meta["kl_coef"], jax.numpy.float32))
        self.watch.load(meta["watch"])
        self.recent_scores = list(meta["recent_scores"])
        self.sync_weights()

    def restore(self) -> bool:
        """`trainer.resume_mode`: continue from a checkpoint; False when starting afresh."""
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return False
        target = self._ckpt_state()
        if t.resume_mode == "resume_path":
            path = Path(t.resume_from_path)
            if not path.name.isdigit():
                raise CheckpointError(f"trainer.resume_from_path: {path} is not a checkpoint "
                                      "step folder (<run>/checkpoints/<step>)")
            with Checkpointer(path.parent) as source:
                got = source.restore(int(path.name), target_state=target)
            origin = str(path)
        else:
            got = self.checkpointer.restore_latest_good(target_state=target)
            if got is None:
                return False
            origin = str(self.checkpointer.directory / str(got.step))
        self._load(got.step, got.state, got.meta)
        print(f"resumed from {origin} at step {got.step} (epoch {self.train_loader.epoch})",
              flush=True)
        self.log({"event": "training/resumed", "from_step": got.step, "path": origin})
        return True

    def roll_back(self, cause: str) -> None:
        """Restores the latest good checkpoint and scales both learning rates by lr_factor."""
        rb = self.cfg.trainer.rollback
        self.rollbacks += 1
        failed = self.global_step
        if self.rollbacks > rb.max_rollbacks:
            raise RollbackLimit(f"step {failed}: {cause}; stopping after "
                                f"trainer.rollback.max_rollbacks={rb.max_rollbacks} rollbacks")
        lr_scale = np.float32(float(self.actor.lr_scale) * rb.lr_factor)
        got = self.checkpointer.restore_latest_good(target_state=self._ckpt_state())
        if got is None:
            raise RollbackLimit(f"step {failed}: {cause}; no checkpoint to roll back to")
        self._load(got.step, got.state, got.meta)
        # From the host, so each state gets a buffer of its own (both are donated).
        scale = lambda s: s._replace(lr_scale=jax.device_put(lr_scale, s.lr_scale.sharding))
        self.actor = scale(self.actor)
        if self.critic is not None:
            self.critic = scale(self.critic)
        print(f"rollback {self.rollbacks}/{rb.max_rollbacks} at step {failed}: {cause}; "
              f"restored step {got.step}, learning rates x{float(lr_scale):.4g}", flush=True)
        self.log({"event": "training/rollbacks", "count": self.rollbacks, "cause": cause,
                  "failed_step": failed, "restored_step": got.step,
                  "lr_scale": float(lr_scale)})
