"""The run state and what saves, restores and rolls it back (`trainer.resume_mode`,
`trainer.rollback`).

`RunState` is everything a run's future depends on, in one value: the actor, critic and
reference (arrays), the KL controller, the step, the data loader's position, the rollback
watch, the recent scores and the rollback count. `Recovery` saves it as one orbax checkpoint
(arrays) plus a JSON dict (the rest), restores it, and rolls it back; it holds no trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from rlhf_jax import lora
from rlhf_jax.checkpoint import Checkpointer, CheckpointError
from rlhf_jax.config import to_dict
from rlhf_jax.core_algos import KLControllerState
from rlhf_jax.rollback import RollbackLimit

# Settings that change which arrays a run state holds, or their shapes.
STRUCTURAL = ("critic.enable", "actor_rollout_ref.actor.use_kl_loss",
              "algorithm.use_kl_in_reward", "actor_rollout_ref.model.", "critic.model.",
              "actor_rollout_ref.actor.optim.", "critic.optim.", "actor_rollout_ref.hybrid_engine",
              "async_training.")


class RunState(NamedTuple):
    """One run's state between two steps."""

    actor: Any  # train_steps.TrainState
    critic: Any | None  # train_steps.TrainState, None without a critic
    ref: Any | None  # reference parameters, None when no KL needs them
    kl: KLControllerState  # the KL-in-reward controller's coefficient
    step: int = 0  # training steps done
    loader: Any = None  # the train loader's position (`PromptLoader.get_state()`)
    epoch: int = 0  # the loader's epoch at that position
    watch: Any = None  # `RollbackWatch.state()`
    recent_scores: tuple[float, ...] = ()  # critic/score/mean of the last 5 steps
    rollbacks: int = 0
    # The one-step-off mode: the rollout's weights of steps step - max_staleness .. step - 1
    # (generate layout), with which the batches in flight were generated (async_rollout.py).
    behaviour: tuple = ()

    def arrays(self) -> dict:
        """The arrays of a checkpoint (orbax)."""
        out = {"actor": self.actor}
        if self.critic is not None:
            out["critic"] = self.critic
        if self.ref is not None:
            out["ref"] = self.ref
        if self.behaviour:
            out["behaviour"] = self.behaviour
        return out

    def meta(self, cfg) -> dict:
        """The JSON part of a checkpoint."""
        return {
            "good": True, "step": self.step, "epoch": self.epoch, "loader": self.loader,
            "kl_coef": float(self.kl.kl_coef), "watch": self.watch,
            "recent_scores": list(self.recent_scores), "rollbacks": self.rollbacks,
            "config": to_dict(cfg),
        }

    def loaded(self, step: int, arrays: dict, meta: dict) -> RunState:
        """This state with a checkpoint's contents, but for the rollback count: a rollback
        keeps its own (`Recovery.roll_back`), a resume takes the checkpoint's
        (`Recovery.restore`)."""
        return self._replace(
            actor=arrays["actor"], critic=arrays.get("critic", self.critic),
            ref=arrays.get("ref", self.ref), behaviour=arrays.get("behaviour", self.behaviour),
            step=step, loader=meta["loader"],
            epoch=int(meta.get("epoch", 0)),
            kl=KLControllerState(jax.numpy.asarray(meta["kl_coef"], jax.numpy.float32)),
            watch=meta["watch"], recent_scores=tuple(meta["recent_scores"]))


class Recovery:
    """Saves, restores and rolls back a `RunState` in `checkpointer`'s directory."""

    def __init__(self, cfg, checkpointer: Checkpointer, trainable: dict | None = None,
                 bases: lora.Bases | None = None):
        self.cfg = cfg
        self.checkpointer = checkpointer
        # LoRA roles: a checkpoint holds their trainable part and its optimizer state, and
        # the meta names their frozen base (`lora.BaseRef`).
        self.trainable = trainable or {}
        self.bases = bases

    def _arrays(self, state: RunState) -> dict:
        arrays = state.arrays()
        return {k: lora.pruned(self.trainable[k], v) if k in self.trainable else v
                for k, v in arrays.items()}

    def _loaded(self, state: RunState, got) -> RunState:
        arrays = dict(got.state)
        for role, t in self.trainable.items():
            if role in arrays:
                arrays[role] = lora.unpruned(t, arrays[role], getattr(state, role))
                if self.bases is not None and role in self.bases.models:
                    arrays[role] = self.bases.restored(role, arrays[role],
                                                       got.meta.get("lora_base", {}))
        return state.loaded(got.step, arrays, got.meta)

    def save(self, state: RunState) -> None:
        """Starts an asynchronous checkpoint of this step (`checkpoints/<step>`)."""
        meta = state.meta(self.cfg)
        if self.bases is not None and self.bases.models:
            meta["lora_base"] = self.bases.meta()
        self.checkpointer.save(state.step, self._arrays(state), meta, force=True)

    def restore(self, state: RunState) -> tuple[RunState, str] | None:
        """`trainer.resume_mode`: `state` (a template of the right shapes and shardings)
        filled from a checkpoint, and where it came from; None when starting afresh."""
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return None
        target = self._arrays(state)
        if t.resume_mode == "resume_path":
            path = Path(t.resume_from_path)
            if not path.name.isdigit():
                raise CheckpointError(f"trainer.resume_from_path: {path} is not a checkpoint "
                                      "step folder (<run>/checkpoints/<step>)")
            if not path.is_dir():  # before orbax creates its parent
                raise CheckpointError(f"trainer.resume_from_path: {path} not found")
            with Checkpointer(path.parent) as source:
                got = source.restore(int(path.name), target_state=target)
            origin = str(path)
        else:
            try:
                got = self.checkpointer.restore_latest_good(target_state=target)
            except CheckpointError as e:
                raise self._other_config(e) from None
            if got is None:
                return None
            origin = str(self.checkpointer.directory / str(got.step))
        # The rollback count goes on across restarts, so max_rollbacks bounds the whole run
        # (checkpoints written before it was saved count 0).
        state = self._loaded(state, got)
        return state._replace(rollbacks=int(got.meta.get("rollbacks", 0))), origin

    def _other_config(self, error: CheckpointError) -> CheckpointError:
        """`error`, or what it likely means: the directory holds another configuration's
        checkpoints (intact ones, whose arrays do not fit this run's)."""
        ckpt = self.checkpointer
        try:
            saved = ckpt.read_meta(ckpt.latest_step())["config"]
        except Exception:  # no readable config: the checkpoints are damaged indeed
            return error
        # The settings that decide which arrays a checkpoint holds first.
        diff = sorted(config_diff(saved, to_dict(self.cfg)),
                      key=lambda d: not d.startswith(STRUCTURAL))
        if not diff:
            return error
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        return CheckpointError(
            f"{ckpt.directory} holds checkpoints of another configuration ({shown}); "
            "resume with that configuration, or set another trainer.default_local_dir "
            "(or trainer.resume_mode=disable to start afresh there)")

    def roll_back(self, state: RunState, cause: str, newest: int | None = None
                  ) -> tuple[RunState, dict]:
        """The latest good checkpoint (at most step `newest`) with both learning rates
        scaled by `lr_factor`, and the `training/rollbacks` event; `RollbackLimit` past
        `max_rollbacks`."""
        rb = self.cfg.trainer.rollback
        rollbacks, failed = state.rollbacks + 1, state.step
        if rollbacks > rb.max_rollbacks:
            raise RollbackLimit(f"step {failed}: {cause}; stopping after "
                                f"trainer.rollback.max_rollbacks={rb.max_rollbacks} rollbacks")
        lr_scale = np.float32(float(state.actor.lr_scale) * rb.lr_factor)
        got = self.checkpointer.restore_latest_good(target_state=self._arrays(state),
                                                    newest=newest)
        if got is None:
            raise RollbackLimit(f"step {failed}: {cause}; no checkpoint to roll back to")
        state = self._loaded(state, got)._replace(rollbacks=rollbacks)
        # From the host, so each state gets a buffer of its own (both are donated).
        scale = lambda s: s._replace(lr_scale=jax.device_put(lr_scale, s.lr_scale.sharding))
        state = state._replace(actor=scale(state.actor), critic=None if state.critic is None
                               else scale(state.critic))
        print(f"rollback {rollbacks}/{rb.max_rollbacks} at step {failed}: {cause}; "
              f"restored step {got.step}, learning rates x{float(lr_scale):.4g}", flush=True)
        event = {"event": "training/rollbacks", "count": rollbacks, "cause": cause,
                 "failed_step": failed, "restored_step": got.step, "lr_scale": float(lr_scale)}
        return state, event


def config_diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """`key: saved -> current` for each differing leaf, `trainer.*` left out (where and how
    long a run trains does not change its state's structure)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        path = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if path == "trainer":
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, path + ".")
        elif a != b and not (isinstance(a, list | tuple) and isinstance(b, list | tuple)
                             and list(a) == list(b)):
            out.append(f"{path}: {a!r} -> {b!r}")
    return out
