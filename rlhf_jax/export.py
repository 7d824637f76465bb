"""A trainer checkpoint -> an HF model directory: `scripts/export_hf.py CHECKPOINT OUT_DIR`.

CHECKPOINT is a step folder of a run, `<trainer.default_local_dir>/checkpoints/<step>`, or a
run directory (or its `checkpoints/` folder), which means its newest good, intact step, the
one `trainer.resume_mode=auto` would resume from (`Checkpointer.restore_latest_good`: damaged
newer steps are skipped with a warning). The resolved config saved in it says which model the
actor is; its parameters are restored onto one device and written with `save_hf`
(config.json, safetensors), next to the tokenizer files of the run's tokenizer, so that
`transformers` loads the directory as it is. `generation_config.json` holds the run's ids and
sampling (`generation_config`), replacing any the tokenizer directory had.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import lora, paths, roles
from rlhf_jax import train_steps as ts
from rlhf_jax.checkpoint import Checkpointer, CheckpointError, DamagedCheckpoint
from rlhf_jax.config import config_from_dict
from rlhf_jax.models import lora as mlora
from rlhf_jax.models.hf_io import load_hf_params, save_hf
from rlhf_jax.tokenizer import load_tokenizer


def _abstract_train_state(model, optim_cfg) -> ts.TrainState:
    """What a checkpoint holds of a role: its trainable part (with LoRA, the adapters) and
    that part's optimizer state (`lora.pruned`)."""
    params = lora.trainable(model).split(model.abstract_params())[0]
    opt_state = jax.eval_shape(ts.make_optimizer(optim_cfg).init, params)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    return ts.TrainState(params, opt_state, scalar(jnp.int32), scalar(jnp.float32),
                         scalar(jnp.int32))


def checkpoint_template(cfg) -> dict:
    """Shapes and dtypes of what `Trainer` saves for `cfg` (actor, critic, ref, and the
    one-step-off mode's older rollout weights)."""
    arr = cfg.actor_rollout_ref
    actor = roles.actor_model(cfg)
    optim = lambda o, clip: ts.OptimConfig.from_config(o, clip, 1)
    out = {"actor": _abstract_train_state(actor, optim(arr.actor.optim, arr.actor.grad_clip))}
    if cfg.critic.enable:
        critic, _ = roles.critic_model(cfg)
        out["critic"] = _abstract_train_state(critic, optim(cfg.critic.optim,
                                                             cfg.critic.grad_clip))
    if (cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss) and actor.cfg.lora is None:
        out["ref"] = actor.abstract_params()  # (a LoRA actor's reference is its base)
    if not arr.hybrid_engine and cfg.async_training.max_staleness:  # the rollout's weights
        out["behaviour"] = (actor.abstract_params(),) * cfg.async_training.max_staleness
    return out


def generation_config(cfg, tokenizer) -> dict:
    """The `generation_config.json` of a run: its tokenizer's bos / eos / pad ids, and the
    rollout's sampling (`actor_rollout_ref.rollout.{do_sample, temperature, top_p, top_k}`)
    with the response limit (`data.max_response_length`) as transformers names them.

    Greedy rollouts (`do_sample: false` or temperature 0) write `do_sample: false` alone,
    since transformers warns about sampling fields that greedy decoding ignores; top_k -1
    (off) is transformers' 0.
    """
    ro = cfg.actor_rollout_ref.rollout
    eos = list(tokenizer.eos_token_ids)
    out = {"bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": eos[0] if len(eos) == 1 else eos,
           "pad_token_id": tokenizer.pad_token_id,
           "max_new_tokens": cfg.data.max_response_length}
    if not ro.do_sample or ro.temperature == 0:
        return {**out, "do_sample": False}
    return {**out, "do_sample": True, "temperature": ro.temperature, "top_p": ro.top_p,
            "top_k": ro.top_k if ro.top_k > 0 else 0}


def _checkpoints_of(path: Path) -> tuple[Path, int | None]:
    """(the run's checkpoints folder, the step) of a step folder; step None for a run
    directory or its checkpoints folder."""
    if path.is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    if (path / paths.CHECKPOINTS).is_dir():
        return path / paths.CHECKPOINTS, None
    if path.is_dir() and path.name == paths.CHECKPOINTS:
        return path, None
    raise CheckpointError(f"{path} is neither a checkpoint step folder "
                          "(<run>/checkpoints/<step>) nor a run directory with checkpoints/")


def _run_config(ckpt: Checkpointer):
    """The resolved config of the newest step whose metadata reads."""
    for step in reversed(ckpt.all_steps()):
        try:
            return config_from_dict(ckpt._read_meta(step)["config"])
        except Exception:  # damaged: restore_latest_good says so, with the step it takes
            continue
    raise CheckpointError(f"no checkpoint in {ckpt.directory}")


def export_hf(checkpoint: str | Path, out_dir: str | Path, fmt: str = "merged"
              ) -> tuple[Path, int]:
    """Writes the actor of `checkpoint` (a `checkpoints/<step>` folder, or a run directory:
    its newest good, intact step) as an HF directory.

    A LoRA actor (its checkpoint holds the adapters and names its base, `lora.BaseRef`,
    checked against the base's files) is written `merged` (W + (alpha / r) A B: a plain HF
    model) or as a `peft` adapter directory for its base (`models.lora.save_peft`).

    Returns:
      (the directory written, the step exported).
    """
    folder, step = _checkpoints_of(Path(checkpoint))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with Checkpointer(folder, async_save=False) as ckpt:
        if step is not None:
            try:
                cfg = config_from_dict(ckpt._read_meta(step)["config"])
            except CheckpointError:
                raise
            except Exception as e:  # orbax raises many types for a damaged file
                raise DamagedCheckpoint(step, Path(checkpoint), f"meta unreadable: {e}"
                                        .splitlines()[0]) from None
            got = ckpt.restore(step, target_state=checkpoint_template(cfg), shardings=device)
        else:
            cfg = _run_config(ckpt)
            got = ckpt.restore_latest_good(target_state=checkpoint_template(cfg),
                                           shardings=device)
            if got is None:
                raise CheckpointError(f"no checkpoint in {folder}")
            cfg = config_from_dict(got.meta["config"])
    model_cfg = cfg.actor_rollout_ref.model
    tokenizer_dir = model_cfg.tokenizer_path or model_cfg.path
    model = roles.actor_model(cfg)
    params = jax.tree.map(np.asarray, got.state["actor"].params)
    spec = model.cfg.lora
    if spec is None and fmt == "peft":
        raise CheckpointError("--format peft: this checkpoint's actor has no LoRA adapters "
                              "(actor_rollout_ref.model.lora_rank 0); use --format merged")
    if spec is not None:
        base_ref = lora.BaseRef.from_meta(got.meta.get("lora_base", {}).get("actor", {}))
        if fmt == "peft":
            n = model.cfg.num_hidden_layers
            return mlora.save_peft(params, spec, n, out_dir, base_ref.path), got.step
        bare = lora.base_model(model)
        base = load_hf_params(bare, base_ref.path, jax.tree.map(
            lambda _: device, bare.abstract_params()))
        model, params = bare, mlora.merge(mlora.with_adapters(base, mlora.adapters(params)),
                                          spec)
    out = save_hf(model, params, out_dir, tokenizer_dir=tokenizer_dir)
    gen = generation_config(cfg, load_tokenizer(tokenizer_dir))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out, got.step
