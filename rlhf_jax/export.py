"""A trainer checkpoint -> an HF model directory: `scripts/export_hf.py CHECKPOINT OUT_DIR`.

CHECKPOINT is a step folder of a run, `<trainer.default_local_dir>/checkpoints/<step>`. The
resolved config saved in it says which model the actor is; its parameters are restored onto
one device and written with `save_hf` (config.json, safetensors), next to the tokenizer files
of the run's tokenizer, so that `transformers` loads the directory as it is.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import roles
from rlhf_jax import train_steps as ts
from rlhf_jax.checkpoint import Checkpointer, CheckpointError
from rlhf_jax.config import config_from_dict
from rlhf_jax.models.hf_io import save_hf


def _abstract_train_state(model, optim_cfg) -> ts.TrainState:
    params = model.abstract_params()
    opt_state = jax.eval_shape(ts.make_optimizer(optim_cfg).init, params)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    return ts.TrainState(params, opt_state, scalar(jnp.int32), scalar(jnp.float32),
                         scalar(jnp.int32))


def checkpoint_template(cfg) -> dict:
    """Shapes and dtypes of what `Trainer` saves for `cfg` (actor, critic, ref)."""
    arr = cfg.actor_rollout_ref
    actor = roles.actor_model(cfg)
    optim = lambda o, clip: ts.OptimConfig.from_config(o, clip, 1)
    out = {"actor": _abstract_train_state(actor, optim(arr.actor.optim, arr.actor.grad_clip))}
    if cfg.critic.enable:
        critic, _ = roles.critic_model(cfg)
        out["critic"] = _abstract_train_state(critic, optim(cfg.critic.optim,
                                                             cfg.critic.grad_clip))
    if cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss:
        out["ref"] = actor.abstract_params()
    return out


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Writes the actor of `checkpoint` (a `checkpoints/<step>` folder) as an HF directory."""
    path = Path(checkpoint)
    if not path.name.isdigit() or not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint step folder "
                              "(<run>/checkpoints/<step>)")
    with Checkpointer(path.parent, async_save=False) as ckpt:
        meta = ckpt._read_meta(int(path.name))
        cfg = config_from_dict(meta["config"])
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        got = ckpt.restore(int(path.name), target_state=checkpoint_template(cfg),
                           shardings=device)
    model_cfg = cfg.actor_rollout_ref.model
    params = jax.tree.map(np.asarray, got.state["actor"].params)
    return save_hf(roles.actor_model(cfg), params, out_dir,
                   tokenizer_dir=model_cfg.tokenizer_path or model_cfg.path)
