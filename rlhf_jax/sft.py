"""A short supervised warm start on the data's ground truths (`trainer.sft_warmup`).

A synthetic task starts from a random model that no policy gradient can move (its reward is
never seen). The warm start trains next-token cross-entropy on `prompt -> target <eos>` (the
row's worked solution `extra_info.answer` if it has one, else its ground truth) and stops as
soon as the *sampled* score on a validation batch reaches `target_score`, so PPO starts from a
weak but non-zero policy, as a real run starts from an instruction-tuned model.

With `label_smoothing` e the targets are `(1 - e) * one-hot + e * uniform` over the answer
vocabulary (the ids that occur in the answers, EOS included): the policy learns which token is
right (greedy decoding gets it) but samples each answer token with only ~1 - e confidence,
so its sampled exact match stays low and PPO has to turn knowledge into reliability from the
reward alone. Without it a policy that samples a low score has not learnt the task yet, and
PPO must learn it from a sparse reward, which takes far more steps. The printed loss
includes the smoothing term (its floor is the entropy of the smoothed target, not 0).
"""

from __future__ import annotations

import contextlib
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlhf_jax import batching, lora, paths
from rlhf_jax import train_steps as ts
from rlhf_jax.core_algos import logprobs_from_logits, masked_mean
from rlhf_jax.errors import ConfigError
from rlhf_jax.models.hf_io import save_hf
from rlhf_jax.progress import duration


def answer_tokens(tokenizer, truths, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Ground-truth strings -> right-padded `[B, R]` ids ending in EOS, and their mask."""
    eos, pad = tokenizer.eos_token_ids[0], tokenizer.pad_token_id
    ids = np.full((len(truths), length), pad, np.int32)
    mask = np.zeros((len(truths), length), np.int32)
    for i, truth in enumerate(truths):
        row = (tokenizer.encode(str(truth)) + [eos])[:length]
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def target(ground_truth, extra_info) -> str:
    """What the warm start teaches a row: its worked solution `extra_info["answer"]` when it
    has one (verl's GSM8K preprocessing and the word-problem task store it), else its ground
    truth (the addition task's answer is the whole response)."""
    answer = (extra_info or {}).get("answer")
    return str(ground_truth if answer is None else answer)


def answer_vocabulary(tokenizer, truths, vocab_size: int) -> np.ndarray:
    """`[V]` bool: the ids that occur in the answers `truths` (their EOS included)."""
    length = max(len(tokenizer.encode(str(t))) for t in truths) + 1
    ids, mask = answer_tokens(tokenizer, truths, length)
    out = np.zeros(vocab_size, bool)
    out[np.unique(ids[mask.astype(bool)])] = True
    return out


def _sft_step(state: ts.TrainState, seqs: ts.Sequences, smooth_over, *, model, tx,
              label_smoothing: float = 0.0):
    def loss_fn(params):
        logits = ts.response_logits(model, params, seqs)
        nll = -logprobs_from_logits(logits, seqs.responses)
        if label_smoothing:
            # Cross-entropy against (1 - e) * one-hot + e * uniform over the answer vocabulary
            # `smooth_over` ([V] 0/1): the policy learns which digit is right but stays unsure,
            # and never learns to emit tokens that no answer contains.
            logp_v = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
            uniform = -jnp.sum(logp_v * smooth_over, -1) / jnp.sum(smooth_over)
            nll = (1.0 - label_smoothing) * nll + label_smoothing * uniform
        return masked_mean(nll, seqs.response_mask)

    loss, grads = jax.value_and_grad(loss_fn)(model.split_layers(state.params))
    grads = model.stack_layers(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state._replace(params=params, opt_state=opt_state, step=state.step + 1), loss


def warm_start(trainer, run_state):
    """The run state with the actor warm-started (a fresh optimizer after it), the reference
    set to it and a critic built on the actor's backbone starting from it. Uses the
    trainer's data, tokenizer and engine (it samples to check the score); changes nothing
    of the trainer but the engine's weights."""
    cfg = trainer.cfg.trainer.sft_warmup
    if not cfg.enable or cfg.max_steps <= 0:
        return run_state
    lay = trainer.layouts
    dataset = trainer.train_loader.dataset
    r = trainer.cfg.data.max_response_length
    tx = optax.adam(cfg.lr)
    # LoRA: the warm start trains the base (the synthetic task's stand-in for a pretrained
    # model), then the adapters start on it (B = 0) and the base is saved as the run's
    # LoRA base (`lora.BaseRef`: what a resume loads).
    adapter_tree = lora.adapters(run_state.actor.params)
    if adapter_tree and jax.process_count() > 1:  # each host would write the one base
        raise ConfigError("trainer.sft_warmup with LoRA (actor_rollout_ref.model.lora_rank > 0) "
                          "runs on one host only: warm-start the base in a one-host run, "
                          "export it and point actor_rollout_ref.model.path at it")
    model = lora.base_model(trainer.actor_model)
    state = ts.init_state(lora.strip(run_state.actor.params), tx)
    sh = jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(functools.partial(_sft_step, model=model, tx=tx,
                                     label_smoothing=float(cfg.label_smoothing)),
                   in_shardings=(sh, None, None), out_shardings=(sh, None), donate_argnums=0)
    vocab = trainer.actor_model.cfg.vocab_size
    smooth_over = np.ones(vocab, np.float32)
    if cfg.label_smoothing:
        truths = [target(dataset[j]["ground_truth"], dataset[j]["extra_info"])
                  for j in range(len(dataset))]
        smooth_over = answer_vocabulary(trainer.tokenizer, truths, vocab).astype(np.float32)
    eval_loader = trainer.val_loader or trainer.train_loader
    eval_batch = eval_loader.dataset.collate(
        [eval_loader.dataset[i] for i in range(min(len(eval_loader.dataset), 256))]
    )
    rng = np.random.default_rng(trainer.cfg.trainer.seed)
    bs = min(cfg.batch_size, len(dataset))
    bs -= bs % lay.dp
    score, loss = 0.0, float("nan")
    progress, start = trainer.progress, time.perf_counter()
    bar = progress.bar("sft warm start", cfg.max_steps)
    for i in range(1, cfg.max_steps + 1):
        batch = dataset.collate([dataset[j] for j in rng.choice(len(dataset), bs, replace=False)])
        truths = [target(*row) for row in zip(batch.ground_truth, batch.extra_info, strict=True)]
        ans, ans_mask = answer_tokens(trainer.tokenizer, truths, r)
        seqs = ts.Sequences.padded(
            np.concatenate([batch.input_ids, ans], 1),
            np.concatenate([batch.attention_mask, ans_mask], 1), ans, ans_mask,
        )
        with progress.phase("sft warm start: compiling its step") if i == 1 \
                else contextlib.nullcontext():
            state, loss = step(state, batching.put(seqs, lay.mesh, lay.batch_axes, lead=0),
                               smooth_over)
        bar.update(1)
        if i % cfg.eval_every == 0 or i == cfg.max_steps:
            trainer.sync_weights(lora.with_adapters(state.params, adapter_tree), rebase=True)
            exp = trainer.generate(eval_batch, 1, trainer.sampling(), jax.random.key(i))
            score = float(np.mean(trainer.score(eval_batch, exp, 1)))
            progress.note(f"sft warm start {i}/{cfg.max_steps} | loss={float(loss):.4g} "
                          f"| sampled score={score:.3f}")
            if score >= cfg.target_score:
                break
    bar.close()
    why = (f"target reached (sampled score {score:.3f} >= target_score {cfg.target_score})"
           if score >= cfg.target_score else
           f"max_steps reached (sampled score {score:.3f} < target_score {cfg.target_score})")
    progress.note(f"sft warm start: stopped at step {i}/{cfg.max_steps}, {why}, "
                  f"in {duration(time.perf_counter() - start)}")
    actor = ts.init_state(lora.with_adapters(state.params, adapter_tree),
                          ts.make_optimizer(trainer.actor_optim), trainer.trainable["actor"])
    trainer.sync_weights(actor.params, rebase=True)
    run_state = run_state._replace(actor=actor)
    if adapter_tree:
        base_dir = save_hf(model, state.params, trainer.run_dir / paths.LORA_BASE)
        for role in ("actor", "critic") if trainer.cfg.critic.model.path is None else ("actor",):
            trainer.lora_bases.set(role, base_dir)
    if run_state.ref is not None:  # the reference is the warm-started policy
        run_state = run_state._replace(ref=jax.tree.map(jnp.copy, state.params))
    if run_state.critic is not None and trainer.cfg.critic.model.path is None:
        # a critic initialised from the actor's backbone starts from the warm-started one
        params = lora.with_adapters({**run_state.critic.params,  # its adapters, if any, kept
                                     "model": jax.tree.map(jnp.copy, state.params["model"])},
                                    lora.adapters(run_state.critic.params))
        run_state = run_state._replace(critic=ts.init_state(
            params, ts.make_optimizer(trainer.critic_optim), trainer.trainable["critic"]))
    return run_state
