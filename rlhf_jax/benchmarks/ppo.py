"""PPO benchmark: one iteration of `/work/shared/bench/WORKLOAD.md`, stage by stage.

The iteration is the trainer's (`Trainer.step`), built from the same pieces on a `single`
(1,1,1) mesh: engine rollout (EOS disabled: eos id 1024, one past the vocabulary) -> reward
(fraction of even response ids, on the last token) -> old log-probs -> ref log-probs (frozen
initial policy) -> adv (k1 KL 0.001 in the reward, GAE gamma 1 lam 0.95) -> critic update ->
actor update (one mini-batch of 32, micro-batch 8, AdamW, no clipping, no weight decay) ->
update_weights (train -> generate layout). 2 warm-up + 5 measured iterations, a fresh batch
of prompts each; every figure is a median over the measured ones. With one critic update an
iteration, the trainer's default (`critic.values_in_update`) takes the rollout's values from
that update's forward pass (GAE's returns computed in the same call, the advantages whitened
after it), so there is no separate `values` stage; `values_in_update=False` runs verl's
separate values pass.

- `ppo.seconds_per_iteration`, `ppo.tokens_per_s` (= 32 * 128 / median seconds).
- `ppo.stage.<name>`: median seconds of each stage that runs (they block, as the
  trainer's do).
- `ppo.flop_bound_ratio`: model FLOPs of the iteration / (measured matmul peak x seconds);
  the peak (`mfu.matmul_peak_flops`, best of 5 jitted 1024 x 1024 f32 matmuls) is sampled
  after every measured iteration and the median taken. Target: >= 0.7 (~1.5x TRL).
  FLOPs follow WORKLOAD.md: N = matmul parameters without the embedding lookup (3.16M);
  rollout 2N per token, old/ref/values 3 x 2N, updates 2 x 6N, plus attention counted over
  the full 128 x 128 score matrix of every pass (4 L heads head_dim T^2 per forward, x3 per
  update), which gives WORKLOAD.md's ~9 %.
- `ppo.trl_tokens_per_s_reference`: TRL's figure from WORKLOAD.md, a reference measured
  there (idle machine, 2026-12-02), not in this run.
- With `trl_python` (`scripts/bench.py ppo --trl-python PYTHON`, the Python of an environment
  with torch, transformers and trl 1.12): TRL's PPOTrainer on the same workload
  (`peers/trl_ppo.py`, a subprocess), in turns with this trainer: warm-up, then `rounds` times
  one TRL run (2 warm-up + `repeats` iterations) and `repeats` iterations here. `ppo.trl.*` are
  TRL's figures (medians over every measured TRL iteration), `ppo.ratio_to_trl` our tokens/s
  over TRL's, both from this run. Target: >= 1.5.
- `ppo.bypass.*`: the same iteration with verl's bypass mode
  (`algorithm.rollout_correction.bypass_mode=true`): the old log-probs are the engine's,
  taken while sampling, as TRL takes them; no old_log_prob stage. Run right after each
  measured iteration on the same prompts: `seconds_per_iteration`, `tokens_per_s` and,
  with TRL, `ratio_to_trl`. The main figures above keep verl's default (recomputed).
- `ppo.cpu_steal_fraction`: the share of CPU time the hypervisor took during the measured
  iterations (Linux `/proc/stat`; absent elsewhere): a slow run of a shared VM shows here.
- `ppo.compiles_measured`: XLA compilations during the measured iterations (0 if every step
  compiles once).

At `scale="0.5b"` (for one accelerator): the same iteration on the Qwen2.5-0.5B architecture
with bfloat16 compute, 64 prompts of 128 tokens, 128 new tokens each, micro-batch 16, against a
bfloat16 8192^3 matmul peak, 1 warm-up and 3 measured iterations. TRL's run belongs to the
workload scale only.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlhf_jax import batching, ppo
from rlhf_jax import train_steps as ts
from rlhf_jax.benchmarks.common import (
    SMALL_MODEL,
    cpu_ticks,
    eos_free_sampling,
    get_scale,
    peak_rss_mb,
    workload_model_config,
    workload_prompts,
)
from rlhf_jax.benchmarks.mfu import FAST_COMPILE, CompileCounter, matmul_peak_flops
from rlhf_jax.errors import UserError
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model
from rlhf_jax.rollout import Engine, generate_sequences, reshard

TRL_TOKENS_PER_S = 1368.0  # WORKLOAD.md, TRL 1.12 PPO on the idle 2-core machine
TRL_SCRIPT = pathlib.Path(__file__).parent / "peers" / "trl_ppo.py"
TRL_WARMUP = 2  # the warm-up iterations of every TRL run (peers/trl_ppo.py)
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
          "update_actor", "update_weights")


def workload_flops(model_cfg, batch: int, seq_len: int) -> float:
    """Model FLOPs of one PPO iteration by WORKLOAD.md's accounting (see the module doc)."""
    c = model_cfg
    n = c.num_matmul_params - c.vocab_size * c.hidden_size  # the embedding is a gather
    attn = 4.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len**2
    forward = batch * (2.0 * n * seq_len + attn)
    return forward * (1 + 3) + 3 * forward * 2  # rollout, old/ref/values, actor+critic


class Stopwatch:
    """Seconds per named stage of one iteration."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, name: str, fn, *args):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        return out


class PPOIteration:
    """The actor, critic, reference and rollout engine of the workload, and one `step`.

    Args:
      batch, prompt_len, new_tokens: prompts per iteration, their length, response length.
      micro_batch: micro-batch rows (gradient accumulation = batch / micro_batch); also the
        chunk of the log-prob / value passes, as in the trainer.
      model_cfg: the architecture (default: WORKLOAD.md's); dtype: its compute dtype.
      steps_per_call, max_prefill_batch: forwarded to `generate_sequences` (None: its
        defaults, which the trainer uses).
      compiler_options: XLA options of every jitted step (the smoke test compiles faster).
      values_in_update: the critic's update makes the rollout's values (the trainer's
        `critic.values_in_update`, default); False: a separate values pass, as verl.
    """

    def __init__(self, *, batch: int = 32, prompt_len: int = 64, new_tokens: int = 64,
                 micro_batch: int = 8, model_cfg=None, dtype: str = "float32",
                 steps_per_call: int | None = None,
                 max_prefill_batch: int | None = None, seed: int = 0,
                 compiler_options: dict | None = None, values_in_update: bool = True):
        self.spec = load_mesh_spec("single")
        self.mesh = make_mesh(self.spec)
        rules = self.spec.train_rules
        cfg = model_cfg or workload_model_config()
        self.batch, self.micro = batch, micro_batch
        self.values_in_update = values_in_update
        self.jit_kw = {"compiler_options": compiler_options} if compiler_options else {}
        self.gen_kw = {k: v for k, v in (("steps_per_call", steps_per_call),
                                          ("max_prefill_batch", max_prefill_batch))
                       if v is not None}
        rng = jax.random.key(seed)
        self.actor_model = Model(cfg, dtype=dtype).with_layout(self.mesh, rules)
        self.critic_model = Model(cfg, "value", dtype=dtype).with_layout(self.mesh, rules)
        no_clip = dict(weight_decay=0.0, grad_clip=0.0)
        self.actor_optim = ts.OptimConfig(lr=1e-6, **no_clip)
        self.critic_optim = ts.OptimConfig(lr=1e-5, **no_clip)
        params = self.actor_model.init(rng, self.mesh, rules)
        self.actor = ts.init_state(params, ts.make_optimizer(self.actor_optim))
        self.ref_params = jax.tree.map(lambda x: x.copy(), params)
        critic_params = self.critic_model.init(jax.random.fold_in(rng, 1), self.mesh, rules)
        self.critic = ts.init_state(critic_params, ts.make_optimizer(self.critic_optim))
        gen_rules = self.spec.generate_rules
        self.gen_shardings = self.actor_model.shardings(self.mesh, gen_rules)
        self.gen_params = reshard(self.actor.params, self.gen_shardings)
        self.sampling = eos_free_sampling(cfg, new_tokens)
        self.engine = Engine(self.actor_model.with_layout(self.mesh, gen_rules), self.mesh,
                             gen_rules, max_concurrent_decodes=batch,
                             max_prefill_length=prompt_len, max_decode_length=new_tokens,
                             prefill_buckets=(prompt_len,), sampling=self.sampling,
                             compiler_options=compiler_options)
        self._compile_steps()
        self.batch_axes = dict(rules).get("batch", ())
        self.seed, self.step_count = seed, 0

    def _compile_steps(self):
        """The trainer's jitted steps (`Trainer._compile_steps`) for this workload."""
        actor_sh = jax.tree.map(lambda x: x.sharding, self.actor)
        critic_sh = jax.tree.map(lambda x: x.sharding, self.critic)
        self.actor_update = jax.jit(
            functools.partial(ts.actor_update, model=self.actor_model,
                              loss=ts.ActorLoss(clip_ratio=0.2), optim=self.actor_optim),
            in_shardings=(actor_sh, None), out_shardings=(actor_sh, None), donate_argnums=0,
            **self.jit_kw)
        critic_kw = dict(model=self.critic_model, loss=ts.CriticLoss(0.2, "token-mean"),
                         optim=self.critic_optim)
        self.critic_update = jax.jit(
            functools.partial(ts.critic_update, **critic_kw),
            in_shardings=(critic_sh, None), out_shardings=(critic_sh, None), donate_argnums=0,
            **self.jit_kw)
        self.critic_update_from_rollout = jax.jit(
            functools.partial(ts.critic_update_from_rollout, gamma=1.0, lam=0.95, **critic_kw),
            in_shardings=(critic_sh, None), out_shardings=(critic_sh, None, None),
            donate_argnums=0, **self.jit_kw)
        self.log_probs = jax.jit(
            functools.partial(ts.log_probs_step, model=self.actor_model, temperature=1.0),
            in_shardings=(actor_sh.params, None), **self.jit_kw)
        self.values = jax.jit(functools.partial(ts.values_step, model=self.critic_model),
                              in_shardings=(critic_sh.params, None), **self.jit_kw)

    def _arranged(self, order, seqs_host: ts.Sequences, extra: dict):
        """`[U, K, m, ...]` device batch plus token / sequence counts (`Trainer._arranged`)."""
        host = jax.tree.map(lambda x: x[order], (seqs_host, extra))
        mask = host[0].response_mask
        token_count = jnp.asarray(mask.sum(axis=(1, 2, 3)).astype(np.float32))
        seq_count = jnp.asarray((mask.sum(-1) > 0).sum(axis=(1, 2)).astype(np.float32))
        dev = batching.put(host, self.mesh, self.batch_axes, lead=2)
        return dev, token_count, seq_count

    def step(self, prompts_bp: np.ndarray, bypass: bool = False) -> dict[str, float]:
        """One PPO iteration on `[B, P]` prompts; returns seconds per stage and `step`.

        `bypass`: verl's `algorithm.rollout_correction.bypass_mode`, the trainer's option
        that takes the engine's log-probs as the old ones (no old_log_prob stage)."""
        watch, t0 = Stopwatch(), time.perf_counter()
        seed = jax.random.fold_in(jax.random.key(self.seed + 1), self.step_count)
        prompt_mask = np.ones_like(prompts_bp)
        ro = watch("gen", lambda: generate_sequences(
            self.engine, self.gen_params, prompts_bp, prompt_mask, n=1, sampling=self.sampling,
            rng=seed, **self.gen_kw))
        scores = watch("reward", lambda: np.mean(ro.responses % 2 == 0, axis=-1).astype(
            np.float32))
        seqs_host = ts.Sequences(
            np.concatenate([prompts_bp, ro.responses], 1).astype(np.int32),
            np.concatenate([prompt_mask, ro.response_mask], 1).astype(np.int32),
            ro.responses.astype(np.int32), ro.response_mask.astype(np.int32))
        seqs = batching.put(jax.tree.map(lambda x: batching.chunked(x, self.micro), seqs_host),
                            self.mesh, self.batch_axes, lead=1)
        if bypass:
            old = jnp.asarray(ro.rollout_log_probs) * jnp.asarray(ro.response_mask, jnp.float32)
        else:
            old = watch("old_log_prob", lambda: batching.unchunk(
                self.log_probs(self.actor.params, seqs)))
        ref = watch("ref", lambda: batching.unchunk(self.log_probs(self.ref_params, seqs)))
        values = None if self.values_in_update else watch("values", lambda: batching.unchunk(
            self.values(self.critic.params, seqs)))
        mask = jnp.asarray(ro.response_mask, jnp.float32)

        def adv_stage():  # the KL in the reward, and GAE where the values are already here
            token_scores = ppo.token_level_scores(jnp.asarray(scores), mask)
            rewards, _ = ppo.kl_in_reward(token_scores, old, ref, mask, 0.001, kind="kl")
            if values is None:  # the critic's update takes the rewards
                return batching.fetch(rewards), None, None
            adv, returns = ppo.advantages(rewards, values, mask,
                                          jnp.arange(self.batch, dtype=jnp.int32),
                                          estimator="gae", gamma=1.0, lam=0.95)
            return None, *batching.fetch((adv, returns))

        rewards, adv, returns = watch("adv", adv_stage)
        host = batching.fetch({"old": old, "ref": ref})
        plan = batching.Plan(self.batch, self.batch, self.micro, 1, True)

        def critic_stage():
            order = plan.order(self.seed * 7919 + self.step_count)
            if values is None:
                (s, ex), tok, sq = self._arranged(order, seqs_host, {"rewards": rewards})
                self.critic, m, outs = self.critic_update_from_rollout(
                    self.critic, ts.CriticRolloutBatch(s, ex["rewards"], tok, sq))
                jax.device_get(m)
                return [batching.unarrange(x, order) for x in batching.fetch(outs)]
            extra = {"values": batching.fetch(values), "returns": returns}
            (s, ex), tok, sq = self._arranged(order, seqs_host, extra)
            self.critic, m = self.critic_update(
                self.critic, ts.CriticBatch(s, ex["values"], ex["returns"], tok, sq))
            return jax.device_get(m)

        def actor_stage():
            order = plan.order(self.seed * 7919 + self.step_count + 1)
            extra = {"old": host["old"], "adv": adv, "ref": host["ref"]}
            (s, ex), tok, sq = self._arranged(order, seqs_host, extra)
            self.actor, m = self.actor_update(
                self.actor, ts.ActorBatch(s, ex["old"], ex["adv"], ex["ref"], tok, sq))
            return jax.device_get(m)

        critic_out = watch("update_critic", critic_stage)
        if values is None:  # GAE's advantages, whitened over the whole batch
            adv = watch("adv", lambda: batching.fetch(ppo.whiten(critic_out[1], mask)))
        watch("update_actor", actor_stage)
        self.gen_params = watch("update_weights",
                                lambda: reshard(self.actor.params, self.gen_shardings))
        self.step_count += 1
        return {**watch.times, "step": time.perf_counter() - t0}


def run_trl(python: str, *args: str) -> dict:
    """The JSON object of `peers/trl_ppo.py *args` run by `python`; a `UserError` naming
    `python` if it cannot run, fails, or its run breaks one of the workload's checks."""
    cmd = [python, str(TRL_SCRIPT), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise UserError(f"--trl-python {python}: cannot run it ({exc.strerror})") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"--trl-python {python}: {TRL_SCRIPT.name} exited with "
                        f"{proc.returncode}: {last}")
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise UserError(f"--trl-python {python}: {TRL_SCRIPT.name} printed no JSON object "
                        f"on its last line") from None
    failed = sorted(k for k, v in out.get("trl.checks", {}).items() if v is False)
    if failed:
        raise UserError(f"--trl-python {python}: TRL's run failed the workload checks "
                        f"{', '.join(failed)}")
    return out


@functools.cache
def check_trl(python: str, script: pathlib.Path) -> dict:
    """`run_trl(python, "--check")` once per Python and script: the versions it reports, or
    the `UserError` of a broken environment, before any benchmark runs."""
    return run_trl(python, "--check")


def _trl_figures(runs: list[dict], tokens: int) -> dict:
    """Medians over the measured iterations of every TRL run."""
    pooled = lambda key: statistics.median(x for r in runs for x in r[key][TRL_WARMUP:])
    seconds = pooled("trl.iteration_seconds")
    return {
        "ppo.trl.seconds_per_iteration": seconds,
        "ppo.trl.tokens_per_s": tokens / seconds,
        "ppo.trl.stage.gen": pooled("trl.gen_seconds"),
        "ppo.trl.stage.rollout_other": pooled("trl.rollout_other_seconds"),
        "ppo.trl.stage.update": pooled("trl.update_seconds"),
        "ppo.trl.runs": len(runs),
        "ppo.trl.versions": runs[0]["trl.versions"],
    }


SIZES = {  # per scale: prompts per iteration, their length, new tokens, micro-batch rows
    "workload": dict(batch=32, prompt_len=64, new_tokens=64, micro_batch=8),
    "0.5b": dict(batch=64, prompt_len=128, new_tokens=128, micro_batch=16),
}
ITERATIONS = {"workload": (2, 5), "0.5b": (1, 3)}  # per scale: (warm-up, measured)


def run(*, small: bool = False, scale="workload", warmup: int | None = None,
        repeats: int | None = None, trl_python: str | None = None, rounds: int = 2,
        **overrides) -> dict:
    """The WORKLOAD.md iteration, or with `small=True` a shrunken one for the smoke test.

    `scale`: `workload` (WORKLOAD.md) or `0.5b` (see the module doc). `trl_python`: also run
    TRL's PPO on the workload, `rounds` times, in turns with this trainer's measured
    iterations (see the module doc). `overrides` go to `PPOIteration` (e.g.
    `steps_per_call=64` to try a rollout setting).
    """
    scale = get_scale(scale)
    warmup = ITERATIONS[scale.name][0] if warmup is None else warmup
    repeats = ITERATIONS[scale.name][1] if repeats is None else repeats
    if trl_python is not None:
        if scale.name != "workload":
            raise UserError(f"--trl-python runs TRL on WORKLOAD.md's model: it does not go "
                            f"with --scale {scale.name}")
        check_trl(trl_python, TRL_SCRIPT)  # a broken environment fails before any work
    kw = dict(SIZES[scale.name], dtype=scale.dtype, model_cfg=scale.model_config())
    if small:
        from rlhf_jax.models import ModelConfig

        kw = dict(batch=4, prompt_len=8, new_tokens=8, micro_batch=2,
                  model_cfg=ModelConfig.from_hf(SMALL_MODEL), compiler_options=FAST_COMPILE)
        warmup, repeats = 1, 1
    kw.update(overrides)
    it = PPOIteration(**kw)
    rounds = rounds if trl_python is not None else 1
    prompts = workload_prompts(warmup + repeats * rounds, kw["batch"], kw["prompt_len"])
    if small:
        prompts = prompts % it.actor_model.cfg.vocab_size
    counter = CompileCounter()
    records, bypassed, peaks, trl_runs, steal = [], [], [], [], [0, 0]
    for i in range(warmup):
        it.step(prompts[i])
        it.step(prompts[i], bypass=True)
    for r in range(rounds):
        if trl_python is not None:
            trl_runs.append(run_trl(trl_python, "--iterations", str(TRL_WARMUP + repeats)))
        for j in range(repeats):
            before = cpu_ticks()
            with counter.counting(True):
                records.append(it.step(prompts[warmup + r * repeats + j]))
            after = cpu_ticks()
            if before and after:
                steal = [steal[0] + after[0] - before[0], steal[1] + after[1] - before[1]]
            # the peak right after each iteration, under the same load of a shared machine
            peaks.append(matmul_peak_flops(64 if small else scale.peak_n,
                                           repeats=3 if small else 5,
                                           dtype=jnp.dtype(scale.dtype)))
            with counter.counting(True):
                bypassed.append(it.step(prompts[warmup + r * repeats + j], bypass=True))
    peak = statistics.median(peaks)
    med = lambda k: statistics.median(r[k] for r in records)
    seconds = med("step")
    tokens = kw["batch"] * (kw["prompt_len"] + kw["new_tokens"])
    flops = workload_flops(it.actor_model.cfg, kw["batch"], kw["prompt_len"] + kw["new_tokens"])
    out = {
        "ppo.seconds_per_iteration": seconds,
        "ppo.seconds_min": min(r["step"] for r in records),
        "ppo.tokens_per_s": tokens / seconds,
        "ppo.flops_per_iteration": flops,
        "ppo.peak_matmul_flops": peak,
        "ppo.bound_seconds": flops / peak,
        "ppo.flop_bound_ratio": flops / (peak * seconds),
        "ppo.measured_iterations": len(records),
        "ppo.compiles_measured": counter.count,
        "ppo.devices": jax.device_count(),
        "ppo.scale": scale.name,
        "ppo.dtype": scale.dtype,
        "ppo.peak_rss_mb": peak_rss_mb(),
    }
    if scale.name == "workload":  # WORKLOAD.md's TRL figure is for its model only
        out["ppo.trl_tokens_per_s_reference"] = TRL_TOKENS_PER_S
        out["ppo.ratio_to_trl_reference"] = tokens / seconds / TRL_TOKENS_PER_S
    if steal[1] > 0:
        out["ppo.cpu_steal_fraction"] = steal[0] / steal[1]
    bypass_seconds = statistics.median(r["step"] for r in bypassed)
    out["ppo.bypass.seconds_per_iteration"] = bypass_seconds
    out["ppo.bypass.tokens_per_s"] = tokens / bypass_seconds
    if trl_runs:
        out.update(_trl_figures(trl_runs, tokens))
        out["ppo.ratio_to_trl"] = out["ppo.tokens_per_s"] / out["ppo.trl.tokens_per_s"]
        out["ppo.bypass.ratio_to_trl"] = (out["ppo.bypass.tokens_per_s"]
                                          / out["ppo.trl.tokens_per_s"])
    for r in records:  # outside every stage: batch placement, host fetches
        r["other"] = r["step"] - sum(r.get(s, 0.0) for s in STAGES)
    out.update({f"ppo.stage.{s}": med(s) for s in (*STAGES, "other") if s in records[0]})
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1, sort_keys=True))
