"""What `Trainer.make_experience` makes: the `Experience` of one step, and the stages after
the rollout that fill its fields (old_log_prob, ref, values, adv), chosen once from the
config: bypass mode fills the old log-probs from the rollout, the fused critic
(`critic.values_in_update`) leaves the values and advantages to its update.

A stage is `fn(state, exp, chunks) -> exp`: it reads the run state and the experience, and
returns the experience with its field(s) filled; `chunks()` are the padded sequences on the
mesh, which `Trainer.forward` runs (or packs by the pass's token budget).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from rlhf_jax import batching, core_algos, ppo
from rlhf_jax import train_steps as ts
from rlhf_jax.models.lora import strip as lora_strip


class Experience(NamedTuple):
    """One step's sequences and what the stages made of them: host arrays, prompt-major
    (row i*n + j = sample j of prompt i); a field is None until its stage fills it."""

    seqs: ts.Sequences  # [N, ...] padded rows: prompt (left-padded) + response
    index: np.ndarray  # [N] the GRPO group: prompt id within the batch, or any labels
    rollout_log_probs: np.ndarray  # [N, R] the engine's, at the rollout temperature
    scores: np.ndarray | None = None  # [N] the reward function's
    reward_baselines: np.ndarray | None = None  # [N] greedy response's score (ReMax)
    old_log_probs: Any = None  # [N, R]
    sum_pi_squared: Any = None  # [N, R] sum_v pi_v^2 of the old pass (the estimator reads it)
    ref_log_probs: Any = None
    values: Any = None
    token_rewards: Any = None  # scores on the last token, minus the KL penalty
    advantages: Any = None
    returns: Any = None
    rollout_is_weights: Any = None  # [N, R] rollout correction's IS weights (None: off)
    kl: float | None = None  # the batch's KL in the reward (the controller's input)
    pending_rewards: Any = None  # the reward pool's scores in flight (the "reward" stage)
    metrics: dict = {}  # the stages' metrics (never mutated: `with_metrics` makes a new one)
    times: dict = {}  # seconds per stage

    @property
    def response_mask(self) -> np.ndarray:
        return self.seqs.loss_mask

    @property
    def sampled_mask(self) -> np.ndarray:
        """[N, R] the response tokens as sampled: `response_mask` before rollout
        correction's rejection took tokens out of the loss."""
        return self.seqs.segment_ids[:, -self.seqs.targets.shape[-1]:]

    @property
    def prompt_mask(self) -> np.ndarray:
        return self.seqs.segment_ids[:, : -self.seqs.targets.shape[-1]]

    def with_metrics(self, **metrics) -> Experience:
        return self._replace(metrics={**self.metrics, **metrics})


@dataclasses.dataclass(frozen=True)
class Stage:
    """`fn(state, exp, chunks) -> exp`, timed as `timing_s/<name>` (None: not timed)."""

    name: str | None
    fn: Callable


def experience_stages(trainer) -> list[Stage]:
    """The stages after the rollout, chosen once from the config: which one fills which
    field of the `Experience`."""
    cfg = trainer.cfg
    stages = []
    if cfg.algorithm.rollout_correction.bypass_mode:
        stages.append(Stage(None, functools.partial(_old_from_rollout, trainer)))
    else:
        stages.append(Stage("old_log_prob", functools.partial(_old_log_prob, trainer)))
    if trainer.state.ref is not None or trainer.ref_from_base:
        stages.append(Stage("ref", functools.partial(_ref_log_prob, trainer)))
    if trainer.state.critic is not None and not trainer.values_in_update:
        stages.append(Stage("values", functools.partial(_values, trainer)))
    if trainer.reward_pool is not None:  # the scores, scored while the passes above ran
        stages.append(Stage("reward", _collect_rewards))
    adv = functools.partial(_advantages, trainer)
    if not cfg.algorithm.rollout_correction.bypass_mode:  # bypass: in the actor's loss
        # verl corrects right before the advantages, under the same timer.
        adv = _then(functools.partial(_rollout_correction, trainer), adv)
    stages.append(Stage("adv", adv))
    return stages

def _then(first, second):
    """The stage `second` after the stage `first`, as one."""
    return lambda state, exp, chunks: second(state, first(state, exp, chunks), chunks)

def _old_from_rollout(trainer, state, exp, chunks):
    """verl's bypass mode: the engine's log-probs of the tokens it sampled (the policy
    that generated them) are PPO's old log-probs; no forward pass."""
    mask = jax.numpy.asarray(exp.response_mask, jax.numpy.float32)
    return exp._replace(old_log_probs=jax.numpy.asarray(exp.rollout_log_probs) * mask
                        ).with_metrics(**{"training/old_log_prob_recomputed": 0.0})

def _old_log_prob(trainer, state, exp, chunks):
    """The actor's log-probs of the sampled tokens (and `sum_pi_squared` in the same pass
    when the estimator reads it, verl's `actor.calculate_sum_pi_squared`)."""
    old = trainer.forward("old", state.actor.params, exp.seqs, chunks)
    spi = None
    if isinstance(old, tuple):
        old, spi = old
    mask = jax.numpy.asarray(exp.response_mask, jax.numpy.float32)
    mx, mean = ppo.rollout_probs_diff(jax.numpy.asarray(exp.rollout_log_probs), old, mask)
    return exp._replace(old_log_probs=old, sum_pi_squared=spi).with_metrics(**{
        "training/old_log_prob_recomputed": 1.0,
        "training/rollout_probs_diff_max": float(mx),
        "training/rollout_probs_diff_mean": float(mean)})

def collect_rewards(exp: Experience) -> Experience:
    """`exp` with the reward pool's scores (when they were left in flight)."""
    if exp.pending_rewards is None:
        return exp
    return exp._replace(scores=exp.pending_rewards.result().scores, pending_rewards=None)


def _collect_rewards(state, exp, chunks):
    return collect_rewards(exp)

def _ref_log_prob(trainer, state, exp, chunks):
    """The reference's log-probs: its own parameters, or the LoRA actor's frozen base run
    without the adapters (the same arrays, no copy)."""
    params = lora_strip(state.actor.params) if trainer.ref_from_base else state.ref
    ref = trainer.forward("ref", params, exp.seqs, chunks)
    return exp._replace(ref_log_probs=ref)

def _values(trainer, state, exp, chunks):
    values = trainer.forward("values", state.critic.params, exp.seqs, chunks)
    return exp._replace(values=values)

_corrected = jax.jit(core_algos.apply_rollout_correction, static_argnames="correction")


def _rollout_correction(trainer, state, exp, chunks):
    """verl's decoupled rollout correction (`compute_rollout_correction_and_add_to_batch`),
    from the old against the rollout log-probs: the IS weights (if `rollout_is`), the
    rejected tokens taken out of the loss mask (if `rollout_rs`), and the `rollout_corr/*`
    diagnostics, always."""
    correction = core_algos.RolloutCorrection.from_config(
        trainer.cfg.algorithm.rollout_correction)
    weights, mask, metrics = batching.fetch(_corrected(
        exp.old_log_probs, exp.rollout_log_probs, exp.response_mask, correction=correction))
    seqs = exp.seqs._replace(loss_mask=mask.astype(exp.seqs.loss_mask.dtype))
    return exp._replace(seqs=seqs, rollout_is_weights=weights).with_metrics(
        **{k: float(v) for k, v in metrics.items()})

def _advantages(trainer, state, exp, chunks):
    """Token rewards (with the KL in the reward) and, unless the critic's update makes
    the values, the advantages of the configured estimator. The score and the KL penalty
    are on the sampled tokens; the advantages on those the loss keeps (verl's order)."""
    alg = trainer.cfg.algorithm
    mask = jax.numpy.asarray(exp.response_mask, jax.numpy.float32)
    sampled = jax.numpy.asarray(exp.sampled_mask, jax.numpy.float32)
    token_rewards = ppo.token_level_scores(jax.numpy.asarray(exp.scores), sampled)
    if alg.use_kl_in_reward:
        beta = state.kl.kl_coef
        token_rewards, current_kl = ppo.kl_in_reward(
            token_rewards, exp.old_log_probs, exp.ref_log_probs, sampled, beta,
            kind=alg.kl_penalty)
        exp = exp._replace(kl=float(current_kl)).with_metrics(**{
            "actor/reward_kl_penalty": float(current_kl),
            "actor/reward_kl_penalty_coeff": float(beta)})
    exp = exp._replace(token_rewards=token_rewards)
    if trainer.values_in_update:  # the critic's update fills values, advantages, returns
        return exp
    needs = trainer.estimator.needs
    given = lambda name, x: jax.numpy.asarray(x) if name in needs and x is not None else None
    adv, returns = batching.fetch(ppo.advantages(
        token_rewards, mask, estimator=alg.adv_estimator, gamma=float(alg.gamma),
        lam=float(alg.lam), norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        values=exp.values if "values" in needs else None,
        # any labels (verl's string uids too) -> dense int32 ids, on the host
        index=jax.numpy.asarray(core_algos.group_ids(exp.index)) if "index" in needs else None,
        reward_baselines=given("reward_baselines", exp.reward_baselines),
        old_log_probs=given("old_log_probs", exp.old_log_probs),
        sum_pi_squared=given("sum_pi_squared", exp.sum_pi_squared),
        rollout_is_weights=given("rollout_is_weights", exp.rollout_is_weights),
    ))
    return exp._replace(advantages=adv, returns=returns)
