# %% [markdown]
# # rlhf_jax's RL maths in a notebook
# Every cell runs as it is (`python examples/losses_in_a_notebook.py`; the tests run it).
# `rlhf_jax.core_algos` is arrays in, arrays out, and imports nothing but jax and numpy.

# %%
import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import core_algos as ca
from rlhf_jax.core_algos import jitted

# %% [markdown]
# ## GRPO with the group labels a dataset has
# Any integer ids, or verl's string uids: rows with the same label form a group.

# %%
rewards = jnp.zeros((4, 3)).at[:, 1].set(jnp.array([1.0, 0.0, 1.0, 0.0]))  # score on token 1
mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], jnp.float32)  # [batch, time]
adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, jnp.array([7, 7, 42, 42]))
print("grpo, ids 7/42:", adv[:, 0].round(3))                     # +-0.707 per group
uids = np.array(["prompt-a", "prompt-a", "prompt-b", "prompt-b"], dtype=object)
adv_uid, _ = ca.compute_grpo_outcome_advantage(rewards, mask, uids)  # host-side mapping
assert np.allclose(adv, adv_uid)
print("dense ids of the uids:", ca.group_ids(uids))

# %% [markdown]
# ## GAE and the PPO loss, differentiated

# %%
k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
values = 0.1 * jax.random.normal(k1, (4, 3))
gae_adv, returns = ca.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
old_logp = -jax.random.uniform(k2, (4, 3))
logp = old_logp + 0.3 * jax.random.normal(k3, (4, 3))


def loss(logp):
    return ca.compute_policy_loss(old_logp, logp, gae_adv, mask, clip_ratio=0.2,
                                  loss_agg_mode="seq-mean-token-mean")


(pg_loss, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
print(f"pg_loss={float(pg_loss):.4f} clipfrac={float(metrics['pg_clipfrac']):.3f}")

# %% [markdown]
# ## Under jit, with strings and modes
# `jax.jit(ca.kl_penalty)(logp, ref, "low_var_kl")` fails (jit traces the string);
# `jitted.<name>` compiles the same call, its strings and flags static.

# %%
k3_kl = jitted.kl_penalty(logp, old_logp, "low_var_kl")
assert np.allclose(k3_kl, ca.kl_penalty(logp, old_logp, "low_var_kl"), atol=1e-6)
seq_loss, _ = jitted.compute_policy_loss(old_logp, logp, gae_adv, mask, clip_ratio=0.2,
                                         loss_agg_mode="seq-mean-token-sum")
print("k3 kl row 0:", np.asarray(k3_kl[0]).round(3), "| seq-mean-token-sum loss:",
      round(float(seq_loss), 4))


# Inside your own jitted step, pass the mode as a Python constant:
@jax.jit
def step_loss(logp):
    kl = ca.kl_penalty(logp, old_logp, "k2")
    return ca.agg_loss(kl, mask, "token-mean")


print("jitted step kl loss:", round(float(step_loss(logp)), 5))
