"""TRL 1.12 PPOTrainer on the PPO workload of `../shared/bench/WORKLOAD.md`: the same-machine
reference of `scripts/bench.py ppo --trl-python PYTHON`.

Run it with the Python of an environment that has torch, transformers and trl; it imports neither
jax nor rlhf_jax, so it keeps its own copy of the workload's constants:

    python benchmarks/peers/trl_ppo.py [--iterations N]

TRL's log lines go to stderr; stdout gets one JSON object (`trl.seconds_per_iteration`,
`trl.tokens_per_s`, `trl.stage.{gen,update,rollout_other}`, per-iteration lists, versions, and
`trl.checks`: what TRL generated and scored, checked against the workload after the run).

How the workload maps onto `trl.experimental.ppo.PPOTrainer` (NOTE marks an interpretation):

- Policy `Qwen2ForCausalLM`, critic `Qwen2ForSequenceClassification(num_labels=1)`, random init,
  float32 (NOTE: `bf16=False`; PPOConfig defaults to bf16). Reference: TRL's frozen deepcopy of
  the initial policy (`ref_model=None`).
- Reward: `EvenFractionReward`, an nn.Module shaped the way `trl.experimental.utils.get_reward`
  calls it (a backbone returning `hidden_states`, a `score` head); its value at the last response
  token (index 127) is sum(id % 2 == 0) / 64, which TRL adds to that token's reward.
- Prompts: `default_rng(0).integers(3, 1024, (iterations, 32, 64))`, batch i = prompts[i].
  NOTE: TRL's dataloader shuffles; it is replaced by the same one with `shuffle=False`. The
  dataset holds one extra, never-used batch: on the last batch of a dataloader accelerate syncs
  gradients at every micro-batch, which would make the final iteration take 4 optimizer steps.
- Generation: 64 new tokens, `stop_token_id=None` (the policy's EOS is None, nothing stops
  early), top_k 0, top_p 1.0. NOTE: TRL samples at `temperature + 1e-7` and divides the ref and
  training logits by it too. Pad id 1024, never sampled; the tokenizer's EOS is 1024 as well,
  because TRL compares `responses == eos_token_id` (never passed to generate).
- PPO: gamma 1, lam 0.95, k1 KL 0.001 in the reward, clip 0.2, value clip 0.2, 1 epoch, 1
  mini-batch of 32 as 4 micro-batches of 8, no reward whitening, no gradient clipping (TRL's PPO
  loop has none). TRL always whitens the advantages. Old log-probs come from the logits that
  generate returns: the rollout runs generate, one reference forward and one critic forward.
- Optimizer: TRL trains policy and critic as one module with one optimizer on
  `pg_loss + vf_coef * vf_loss`; `vf_loss` is the workload's 0.5 * token-mean of the clipped
  squared error. NOTE: `vf_coef=1.0`, and the AdamW TRL would build (torch AdamW, fused, betas
  (0.9, 0.999), eps 1e-8, no weight decay, constant LR) gets two parameter groups, policy lr 1e-6
  and critic lr 1e-5, as the workload asks.
- Timing (`time.perf_counter`; torch CPU ops are synchronous): an iteration runs from TRL asking
  the dataloader for batch i to asking for batch i+1 (the last one: to the return of `train()`),
  so it includes TRL's per-step logging. `gen` wraps TRL's `batch_generation`; `update` runs from
  the first training forward to the end of the AdamW step (a torch step post-hook);
  `rollout_other` lies between them (reference and critic forwards, reward, GAE). Iterations 1-2
  are warm-up; figures are medians of the rest.
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import numpy as np
import torch
import torch.nn as nn

PROMPT_LEN = 64
RESPONSE_LEN = 64
BATCH = 32
VOCAB = 1024
PAD_ID = 1024  # one past the vocabulary
WARMUP = 2


class _EvenFractionBackbone(nn.Module):
    """Stands in for an LM backbone in `trl.experimental.utils.get_reward`.

    Returns an object whose `.hidden_states[-1]` is (B, T, 1): the running count of even response
    ids (positions >= PROMPT_LEN) over RESPONSE_LEN. Every prompt is exactly PROMPT_LEN tokens (TRL
    passes that context length to get_reward), so position PROMPT_LEN is the first response token.
    """

    def forward(self, input_ids, attention_mask=None, **kwargs):
        even = (input_ids % 2 == 0).to(torch.float32)
        even[:, :PROMPT_LEN] = 0.0
        if attention_mask is not None:
            even = even * attention_mask.to(even.dtype)
        running = even.cumsum(dim=1) / RESPONSE_LEN
        return _Out(hidden_states=(running.unsqueeze(-1),))


class _Out:
    def __init__(self, hidden_states):
        self.hidden_states = hidden_states


class EvenFractionReward(nn.Module):
    """The rule-based reward for TRL's get_reward: sum(response_id % 2 == 0) / 64 at the last
    token."""

    base_model_prefix = "backbone"

    def __init__(self):
        super().__init__()
        self.backbone = _EvenFractionBackbone()
        self.score = nn.Identity()


def build_tokenizer():
    """A local word-level tokenizer over ids 0..1024 (nothing downloaded); TRL uses only its pad and
    eos ids and `.pad()`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB + 1)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=f"t{PAD_ID}", eos_token=f"t{PAD_ID}", padding_side="right"
    )


def qwen2_config(**extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--iterations", type=int, default=7, help="total iterations; the first 2 are warm-up"
    )
    ap.add_argument(
        "--output-dir",
        default=None,
        help="TRL's output_dir (it writes nothing there; default: a temporary dir)",
    )
    ap.add_argument(
        "--check", action="store_true", help="only import TRL's stack and print its versions"
    )
    cli = ap.parse_args()
    n_iter = cli.iterations

    torch.set_num_threads(2)

    import accelerate
    import transformers
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_mod

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "python": sys.version.split()[0],
    }
    if cli.check:
        print(json.dumps({"trl.versions": versions}))
        return
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import (
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Trainer,
        TrainerCallback,
    )
    from transformers.optimization import get_constant_schedule
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    transformers.set_seed(0)  # model init, TRL's np.random.permutation of micro-batches

    policy = Qwen2ForCausalLM(qwen2_config()).to(torch.float32)
    value_model = Qwen2ForSequenceClassification(qwen2_config(num_labels=1)).to(torch.float32)
    reward_model = EvenFractionReward()
    tokenizer = build_tokenizer()

    prompts = np.random.default_rng(0).integers(3, 1024, size=(n_iter, BATCH, PROMPT_LEN))
    rows = prompts.reshape(-1, PROMPT_LEN)
    rows = np.concatenate(
        [rows, prompts[0]], axis=0
    )  # + 1 never-consumed batch, see module docstring
    train_dataset = Dataset.from_dict({"input_ids": rows.tolist()})

    args = PPOConfig(
        output_dir=cli.output_dir or tempfile.mkdtemp(prefix="trl_ppo_"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        gradient_checkpointing=False,
        seed=42,
        # batch geometry
        total_episodes=n_iter * BATCH,  # -> num_total_batches = n_iter
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        num_mini_batches=1,
        num_ppo_epochs=1,
        local_rollout_forward_batch_size=BATCH,
        # sampling
        response_length=RESPONSE_LEN,
        temperature=1.0,
        stop_token=None,
        stop_token_id=None,
        missing_eos_penalty=None,
        # PPO
        gamma=1.0,
        lam=0.95,
        kl_coef=0.001,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=1.0,
        whiten_rewards=False,
        # optimizer (the optimizer we pass below follows the same settings; the lr here is the actor
        # lr)
        learning_rate=1e-6,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=None,  # unused by TRL's PPO loop anyway
        lr_scheduler_type="constant",
        warmup_steps=0,
        # no side work
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        push_to_hub=False,
        dataloader_num_workers=0,
    )

    # Optimizer as transformers/TRL would build it, but two param groups: actor lr 1e-6, critic lr
    # 1e-5.
    opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    opt_kwargs = dict(opt_kwargs)
    opt_kwargs.pop("lr")
    optimizer = opt_cls(
        [
            {
                "params": [p for p in policy.parameters() if p.requires_grad],
                "lr": 1e-6,
                "weight_decay": 0.0,
            },
            {
                "params": [p for p in value_model.parameters() if p.requires_grad],
                "lr": 1e-5,
                "weight_decay": 0.0,
            },
        ],
        **opt_kwargs,
    )

    # Count real (synchronizing) optimizer steps and time the end of each, via torch's official step
    # post-hook (accelerate's AcceleratedOptimizer only calls the inner step() on the synchronizing
    # micro-batch).
    rec_opt_steps = []
    optimizer.register_step_post_hook(lambda opt, a, k: rec_opt_steps.append(time.perf_counter()))
    lr_scheduler = get_constant_schedule(optimizer)

    # ---- timers (wrapping TRL's module-level helpers; behaviour unchanged) ----
    rec = {
        "fetch": [],
        "gen": [],
        "upd_start": [],
        "opt_steps": rec_opt_steps,
        "queries": [],
        "query_responses": [],
        "scores": [],
        "logs": [],
    }
    state = {"in_update": False}

    orig_batch_generation = ppo_mod.batch_generation

    def timed_batch_generation(*a, **k):
        t0 = time.perf_counter()
        out = orig_batch_generation(*a, **k)
        t1 = time.perf_counter()
        rec["gen"].append((t0, t1))
        rec["query_responses"].append(out[0])
        state["in_update"] = False
        return out

    ppo_mod.batch_generation = timed_batch_generation

    orig_forward = ppo_mod.forward

    def timed_forward(model, *a, **k):
        if isinstance(model, ppo_mod.PolicyAndValueWrapper) and not state["in_update"]:
            state["in_update"] = True
            rec["upd_start"].append(time.perf_counter())
        return orig_forward(model, *a, **k)

    ppo_mod.forward = timed_forward

    orig_get_reward = ppo_mod.get_reward

    def recording_get_reward(model, *a, **k):
        out = orig_get_reward(model, *a, **k)
        if model is reward_model:
            rec["scores"].append(out[1])
        return out

    ppo_mod.get_reward = recording_get_reward

    class LogCatcher(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            rec["logs"].append(dict(logs or {}))

    with contextlib.redirect_stdout(
        sys.stderr
    ):  # TRL/accelerate prints go to stderr; stdout = the JSON only
        trainer = PPOTrainer(
            args=args,
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=reward_model,
            train_dataset=train_dataset,
            value_model=value_model,
            optimizers=(optimizer, lr_scheduler),
            callbacks=[LogCatcher()],
        )

        # Deterministic batch order (see docstring): same DataLoader as TRL's, but shuffle=False.
        acc = trainer.accelerator
        dl = DataLoader(
            train_dataset,
            batch_size=trainer.local_dataloader_batch_size,
            shuffle=False,
            collate_fn=trainer.data_collator,
            drop_last=True,
        )
        dl = acc.prepare(dl)

        class TimedLoader:
            """Records the time TRL asks for each batch (= start of a TRL iteration)."""

            def __init__(self, inner):
                self.inner = inner

            def __iter__(self):
                it = iter(self.inner)
                while True:
                    t = time.perf_counter()
                    try:
                        batch = next(it)
                    except StopIteration:
                        return
                    rec["fetch"].append(t)
                    rec["queries"].append(batch["input_ids"])
                    yield batch

            def __len__(self):
                return len(self.inner)

        trainer.dataloader = TimedLoader(dl)

        inner_opt = trainer.optimizer.optimizer
        assert inner_opt is optimizer

        assert acc.mixed_precision == "no", acc.mixed_precision
        assert trainer.policy_model.generation_config.eos_token_id is None
        assert args.num_total_batches == n_iter, args.num_total_batches

        trainer.train()
        t_end = time.perf_counter()

    # ---- per-iteration times ----
    marks = rec["fetch"] + [t_end]
    assert len(rec["fetch"]) == n_iter, len(rec["fetch"])
    iter_s = [marks[i + 1] - marks[i] for i in range(n_iter)]
    gen_s, upd_s, other_s, steps_per_iter = [], [], [], []
    for i in range(n_iter):
        lo, hi = marks[i], marks[i + 1]
        g0, g1 = rec["gen"][i]
        u0 = rec["upd_start"][i]
        steps = [t for t in rec["opt_steps"] if lo <= t <= hi]
        steps_per_iter.append(len(steps))
        gen_s.append(g1 - g0)
        upd_s.append(steps[-1] - u0)
        other_s.append(u0 - g1)

    # ---- correctness checks on what TRL actually generated/scored ----
    checks = {}
    qr_all = torch.stack(rec["query_responses"])  # (n_iter, 32, 128)
    checks["query_response_shape"] = list(qr_all.shape)
    checks["responses_exactly_64_tokens"] = bool(qr_all.shape[-1] == PROMPT_LEN + RESPONSE_LEN)
    resp = qr_all[..., PROMPT_LEN:]
    checks["pad_in_responses"] = int((resp == PAD_ID).sum())
    checks["response_id_range"] = [int(resp.min()), int(resp.max())]
    checks["prompts_match_spec_order"] = all(
        torch.equal(rec["queries"][i], torch.as_tensor(prompts[i]))
        and torch.equal(qr_all[i, :, :PROMPT_LEN], torch.as_tensor(prompts[i]))
        for i in range(n_iter)
    )
    expected = (resp % 2 == 0).sum(-1).to(torch.float32) / RESPONSE_LEN
    got = torch.stack(rec["scores"])
    checks["reward_matches_even_fraction"] = bool(torch.allclose(got, expected, atol=1e-6))
    checks["mean_reward_per_iter"] = [round(float(x), 4) for x in got.mean(-1)]
    checks["trl_logged_objective_scores"] = [
        round(float(lg["objective/scores"]), 4) for lg in rec["logs"] if "objective/scores" in lg
    ]
    checks["trl_logged_num_eos_tokens"] = [
        int(lg["val/num_eos_tokens"]) for lg in rec["logs"] if "val/num_eos_tokens" in lg
    ]
    checks["optimizer_steps_per_iteration"] = steps_per_iter
    checks["param_group_lrs"] = [g["lr"] for g in inner_opt.param_groups]
    wrapper_params = {id(p) for p in trainer.model.parameters()}
    opt_params = {id(p) for g in inner_opt.param_groups for p in g["params"]}
    checks["optimizer_covers_policy_and_critic_exactly"] = wrapper_params == opt_params

    meas = slice(WARMUP, None)
    med = (
        statistics.median(iter_s[meas]) if n_iter > WARMUP else None
    )  # None: no measured iteration
    result = {
        "trl.seconds_per_iteration": med,
        "trl.tokens_per_s": BATCH * (PROMPT_LEN + RESPONSE_LEN) / med if med else None,
        "trl.stage.gen": statistics.median(gen_s[meas]) if n_iter > WARMUP else None,
        "trl.stage.update": statistics.median(upd_s[meas]) if n_iter > WARMUP else None,
        "trl.stage.rollout_other": statistics.median(other_s[meas]) if n_iter > WARMUP else None,
        "trl.peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "trl.versions": versions,
        "trl.iterations": n_iter,
        "trl.warmup_iterations": WARMUP,
        "trl.iteration_seconds": iter_s,
        "trl.gen_seconds": gen_s,
        "trl.update_seconds": upd_s,
        "trl.rollout_other_seconds": other_s,
        "trl.torch_threads": torch.get_num_threads(),
        "trl.checks": checks,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
