"""Plots the PPO policy objective and the KL estimators of `rlhf_jax.core_algos`.

    python scripts/plot_losses.py [--out outputs/plots]

Writes `ppo_objective.png` (the per-token objective, i.e. the negated loss, against the
probability ratio for A > 0 and A < 0: vanilla clip, dual clip, asymmetric clip, and their
gradients) and `kl_estimators.png` (k1, k2, k3 and abs against the log-ratio, with their
gradients). Every curve is computed by the library functions themselves.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlhf_jax import core_algos  # noqa: E402

NO_DUAL_CLIP = 1e9  # a dual-clip bound that never binds: plain PPO clipping


def token_objective(log_ratio, advantage, **clip):
    """The objective -loss of one token with old log-prob 0 and log-prob `log_ratio`."""
    one = jnp.ones((1, 1))
    loss, _ = core_algos.compute_policy_loss(
        0.0 * one, log_ratio * one, advantage * one, one, loss_agg_mode="token-sum", **clip
    )
    return -loss


def objective_curves(ratios, advantage, **clip):
    """(objective, d objective / d ratio) over `ratios` ([n]), vmapped over the tokens."""
    f = lambda r: token_objective(jnp.log(r), advantage, **clip)
    return jax.vmap(f)(ratios), jax.vmap(jax.grad(f))(ratios)


def plot_ppo(path: pathlib.Path) -> None:
    ratios = jnp.linspace(0.05, 4.0, 800)
    variants = [
        ("vanilla clip, eps = 0.2", dict(clip_ratio=0.2, clip_ratio_c=NO_DUAL_CLIP), "C0", "-"),
        ("dual clip, eps = 0.2, c = 3", dict(clip_ratio=0.2, clip_ratio_c=3.0), "C3", "--"),
        ("asymmetric, eps_low = 0.2, eps_high = 0.28",
         dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=NO_DUAL_CLIP), "C2", ":"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, adv in enumerate((1.0, -1.0)):
        top, bottom = axes[0, col], axes[1, col]
        top.plot(ratios, ratios * adv, color="0.6", lw=1, label="unclipped r * A")
        for label, clip, color, style in variants:
            obj, grad = objective_curves(ratios, adv, **clip)
            top.plot(ratios, obj, color=color, ls=style, lw=2, label=label)
            bottom.plot(ratios, grad, color=color, ls=style, lw=2, label=label)
        sign = "A = +1 (good token)" if adv > 0 else "A = -1 (bad token)"
        top.set_title(f"PPO objective per token, {sign}")
        top.set_ylabel("objective = -loss")
        bottom.set_title(f"gradient d objective / d ratio, {sign}")
        bottom.set_ylabel("d objective / d r")
        bottom.set_xlabel("probability ratio r = pi / pi_old")
        for ax in (top, bottom):
            ax.axvline(1.0, color="0.85", lw=1, zorder=0)
            ax.grid(alpha=0.3)
        top.legend(fontsize=8, loc="upper left" if adv > 0 else "lower left")
    axes[0, 1].annotate("dual clip: objective >= A * c = -3\n(loss <= -A * c)", xy=(3.5, -3.0),
                        xytext=(2.2, -1.8),
                        arrowprops=dict(arrowstyle="->"), fontsize=9)
    fig.suptitle("core_algos.compute_policy_loss (the dual clip only acts on A < 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kl(path: pathlib.Path) -> None:
    d = jnp.linspace(-3.0, 3.0, 601)  # log-ratio logp - ref_logp
    ref = jnp.zeros_like(d)[None, :]
    names = [("k1", "k1 = d", "C0", "-"), ("k2", "k2 = d^2 / 2", "C1", "--"),
             ("k3", "k3 (low_var_kl) = exp(-d) + d - 1", "C2", "-"),
             ("abs", "abs = |d|", "C4", ":"), ("k3+", "k3+ (value k3, gradient k2)", "C3", "-.")]
    fig, (ax_v, ax_g) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, label, color, style in names:
        f = lambda logp, name=name: core_algos.kl_penalty(logp, ref, name)
        value = f(d[None, :])[0]
        grad = jax.grad(lambda logp, f=f: jnp.sum(f(logp)))(d[None, :])[0]
        if name != "k3+":  # its value is k3's, drawn already
            ax_v.plot(d, value, color=color, ls=style, lw=2, label=label)
        ax_g.plot(d, grad, color=color, ls=style, lw=2, label=label)
    ax_v.set_title("KL estimators per token (core_algos.kl_penalty)")
    ax_v.set_ylabel("penalty")
    ax_v.set_ylim(-3.2, 6)
    ax_g.set_title("gradient w.r.t. logp")
    ax_g.set_ylabel("d penalty / d logp")
    ax_g.set_ylim(-4, 4)
    ax_g.annotate("k3 clipped at 10:\nzero gradient", xy=(-2.75, -3.5), xytext=(-2.3, -2.2),
                  arrowprops=dict(arrowstyle="->"), fontsize=9)
    for ax in (ax_v, ax_g):
        ax.set_xlabel("log-ratio d = logp - ref_logp")
        ax.axhline(0.0, color="0.85", lw=1, zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/plots", help="output directory")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_ppo(out / "ppo_objective.png")
    plot_kl(out / "kl_estimators.png")
    print(f"wrote {out / 'ppo_objective.png'} and {out / 'kl_estimators.png'}")


if __name__ == "__main__":
    main()
