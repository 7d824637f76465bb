"""DAPO: dynamic sampling (`algorithm.filter_groups`), the overlong buffer
(`reward_model.overlong_buffer`) and the recipe; the pure parts by hand, then one tiny
trainer that runs them (with validation at N)."""

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_run import ROOT, tiny

from rlhf_jax import dynamic_sampling as ds
from rlhf_jax import train_steps as ts
from rlhf_jax.config import load_config, validate_batch_arithmetic
from rlhf_jax.errors import ConfigError
from rlhf_jax.experience import Experience
from rlhf_jax.rewards import Rewards, overlong_penalty, score_batch_info, with_overlong_penalty

# ------------------------------------------------------------------ dynamic sampling, by hand

N = 3  # responses per prompt


def _fake_sample(patterns):
    """`sample(batch, k)` over batches of prompts whose group k scores follow `patterns[k]`
    ('c': all responses alike, 'v': they differ); each row's ids say (batch, prompt, j)."""
    calls = []

    def sample(batch, k):
        calls.append((batch, k))
        groups = len(patterns[batch])
        rows = np.array([[batch, p, j] for p in range(groups) for j in range(N)], np.int32)
        scores = np.array([0.5 if patterns[batch][p] == "c" else j / N
                           for p in range(groups) for j in range(N)], np.float32)
        seqs = ts.Sequences(rows, rows, np.ones_like(rows), rows[:, 1:], np.ones_like(rows[:, 1:]))
        exp = Experience(seqs, np.repeat(np.arange(groups), N), rows.astype(np.float32) / 10,
                         scores=scores)
        return exp, Rewards(scores, scores, {})

    return sample, calls


def test_kept_groups_rule():
    values = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 2, 2, 2.5])
    np.testing.assert_array_equal(ds.kept_groups(values, 3), [False, True, False, True])
    np.testing.assert_array_equal(ds.kept_groups(np.ones(4), 1), [True] * 4)  # groups of one


def test_fill_draws_batches_until_enough_groups_and_trims_the_surplus():
    sample, calls = _fake_sample(["cvcv", "vvcv", "cccc"])
    batches = iter([1, 2])
    exp = ds.fill(sample, lambda: next(batches), 0, n=N, prompts=4, metric="acc",
                  max_num_gen_batches=3)
    assert calls == [(0, 0), (1, 1)]  # batch 1 came from the loader, as generation batch 1
    # kept in generation order: (0, 1), (0, 3), (1, 0), (1, 1); (1, 3) is the surplus
    want = [(0, 1), (0, 3), (1, 0), (1, 1)]
    got = [tuple(r) for r in exp.seqs.input_ids[::N, :2]]
    assert got == want
    np.testing.assert_array_equal(exp.seqs.input_ids[:, 2], np.tile(np.arange(N), 4))
    np.testing.assert_array_equal(exp.index, np.repeat(np.arange(4), N))
    np.testing.assert_array_equal(exp.rollout_log_probs,
                                  exp.seqs.input_ids.astype(np.float32) / 10)
    assert exp.scores.reshape(4, N).std(1).min() > 0
    assert exp.metrics == {"train/num_gen_batches": 2.0,
                           "training/filter_groups/evicted_samples": 3.0,
                           "training/filter_groups/discarded_surplus_samples": 1.0,
                           "training/filter_groups/kept_groups": 5.0}


def test_fill_stops_after_max_num_gen_batches_with_one_line():
    sample, _ = _fake_sample(["cccv"] * 9)
    batches = iter(range(1, 9))
    with pytest.raises(ConfigError) as err:
        ds.fill(sample, lambda: next(batches), 0, n=N, prompts=4, metric="acc",
                max_num_gen_batches=3)
    assert str(err.value) == (
        "algorithm.filter_groups.max_num_gen_batches: 3 generation batches kept 3 of 4 "
        "prompts whose acc differs within the group; the data may be too hard or too easy "
        "for the policy (0: no limit)")
    # 0: no limit, as verl's non-positive values
    sample, calls = _fake_sample(["cccv"] * 9)
    batches = iter(range(1, 9))
    exp = ds.fill(sample, lambda: next(batches), 0, n=N, prompts=4, metric="acc",
                  max_num_gen_batches=0)
    assert len(calls) == 4 and exp.metrics["train/num_gen_batches"] == 4.0


def test_group_metric_names():
    scores, raw = np.array([0.5, -0.5], np.float32), np.array([1.0, 0.0], np.float32)
    plain = Rewards(scores, raw, {})
    for name in ("seq_reward", "seq_final_reward"):  # what the response gets, shaped
        np.testing.assert_array_equal(ds.group_metric(name, plain), scores)
    for name in ("acc", "score"):  # a float reward: its score
        np.testing.assert_array_equal(ds.group_metric(name, plain), raw)
    info = Rewards(scores, raw, {"acc": [True, False], "pred": ["1", "2"], "f1": [0.3, 0.2]})
    np.testing.assert_array_equal(ds.group_metric("acc", info), [1.0, 0.0])
    np.testing.assert_array_equal(ds.group_metric("f1", info), [0.3, 0.2])
    with pytest.raises(ConfigError, match=r"metric: the reward function returns no 'f2' \(known: "
                                          r"seq_reward, seq_final_reward, acc, score, f1, pred\)"):
        ds.group_metric("f2", info)
    with pytest.raises(ConfigError, match="'pred' must be a number for every response, got '1'"):
        ds.group_metric("pred", info)


# ------------------------------------------------------------------------ overlong buffer

def test_overlong_penalty_by_hand():
    # R = 10, B = 4: free up to 6 tokens, then -1/4 per token, -1 at 10 (x penalty_factor)
    lengths = np.array([0, 5, 6, 7, 8, 10])
    np.testing.assert_allclose(
        overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1.0),
        [0, 0, 0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(
        overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=0.5),
        [0, 0, 0, -0.125, -0.25, -0.5])
    rewards = score_batch_info(["openai/gsm8k"] * 3, ["#### 7", "#### 8", "no"], ["7"] * 3)
    assert rewards.info == {"score": [1.0, 0.0, 0.0], "pred": ["7", "8", "[INVALID]"]}
    shaped = with_overlong_penalty(rewards, np.array([3, 10, 8]), max_response_length=10,
                                   buffer_len=4, penalty_factor=1.0, log=True)
    np.testing.assert_allclose(shaped.scores, [1.0, -1.0, -0.5])
    np.testing.assert_array_equal(shaped.raw, [1.0, 0.0, 0.0])
    assert shaped.info["overlong_reward"] == [0.0, -1.0, -0.5]
    assert shaped.info["overlong"] == [False, True, True]
    unlogged = with_overlong_penalty(rewards, np.array([3, 10, 8]), max_response_length=10,
                                     buffer_len=4, penalty_factor=1.0)
    assert unlogged.info == rewards.info


# ------------------------------------------------------------------------- config, recipe

def test_recipe_loads_with_verls_dapo_settings():
    cfg = load_config(ROOT / "configs/dapo_gsm8k_qwen2_5_0_5b.yaml")
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert actor.loss_agg_mode == "token-mean" and not actor.use_kl_loss
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward
    assert not cfg.critic.enable
    groups = cfg.algorithm.filter_groups
    assert (groups.enable, groups.metric, groups.max_num_gen_batches) == (True, "acc", 10)
    buf = cfg.reward_model.overlong_buffer
    assert (buf.enable, buf.len, buf.penalty_factor) == (True, 256, 1.0)
    for dp in (1, 8):
        validate_batch_arithmetic(cfg, dp)


def test_defaults_are_verls():
    cfg = load_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"])
    g, b = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    assert (g.enable, g.metric, g.max_num_gen_batches, g.max_inflight_gen_batches) == (
        False, None, 0, 1)
    assert (b.enable, b.len, b.penalty_factor, b.log) == (False, 0, 0.0, False)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.filter_groups.metric=null"],
     "algorithm.filter_groups.metric: must be set when algorithm.filter_groups.enable is true"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"],
     "algorithm.filter_groups.metric: seq_final_reward with algorithm.use_kl_in_reward=true"),
    (["algorithm.filter_groups.max_inflight_gen_batches=2"],
     "algorithm.filter_groups.max_inflight_gen_batches: only 1 is supported"),
    (["reward_model.overlong_buffer.len=0"],
     "reward_model.overlong_buffer.len: must be >= 1 when"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2048"],
     "reward_model.overlong_buffer.len: 2048 is more than data.max_response_length 1024"),
    (["reward_model.overlong_buffer.penalty_factor=-1"],
     "reward_model.overlong_buffer.penalty_factor: must be >= 0"),
])
def test_bad_keys_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/dapo_gsm8k_qwen2_5_0_5b.yaml", overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ------------------------------------------------------------------- a tiny trainer runs it

def _dapo_overrides(tmp: Path, **extra) -> dict:
    return {
        "mesh": "single", "trainer.sft_warmup.enable": False, "trainer.test_freq": -1,
        "trainer.save_freq": -1, "trainer.total_training_steps": 2,
        "trainer.rollback.enable": False,
        "reward.custom_reward_function.path": str(ROOT / "tests/dapo_reward.py"),
        "algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_num_gen_batches": 4,
        # max_response_length 4: past 2 tokens, -0.5 a token
        "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 2,
        "reward_model.overlong_buffer.penalty_factor": 1.0,
        "actor_rollout_ref.rollout.val_kwargs.n": 4,
        "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
        "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,
        **extra,
    }


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from rlhf_jax.trainer import Trainer

    tmp = tmp_path_factory.mktemp("dapo")
    return Trainer(tiny(tmp, "grpo_tiny_cpu.yaml", **_dapo_overrides(tmp)))


def _first_batch(trainer):
    """Step 1's batch and state, the loader just after that batch (as `run` makes them)."""
    trainer.train_loader.set_state({**trainer.train_loader.get_state(), "epoch": 0, "step": 0})
    batch = trainer._next_batch()
    return batch, trainer.state._replace(step=1, loader=trainer.train_loader.get_state())


def _penalty(lengths):  # max_response_length 4, buffer 2, factor 1
    return np.minimum(-(lengths - 2) / 2, 0)


def test_reward_adds_the_overlong_penalty(trainer):
    from dapo_reward import compute_score

    batch, _ = _first_batch(trainer)
    exp = trainer.generate(batch, 4, trainer.sampling(), 0)  # the step's shapes: one compile
    rewards = trainer.reward(batch, exp, 4)
    lengths = exp.response_mask.sum(-1)
    assert set(lengths) > {4}  # some responses reach the hard limit, some do not
    texts = [trainer.tokenizer.decode(r[:k].tolist())
             for r, k in zip(exp.seqs.targets, lengths, strict=True)]
    raw = [compute_score("", t, g)["score"]
           for t, g in zip(texts, np.repeat(batch.ground_truth, 4), strict=True)]
    np.testing.assert_allclose(rewards.raw, raw, rtol=1e-6)
    np.testing.assert_allclose(rewards.scores, np.array(raw) + _penalty(lengths), rtol=1e-6)


def test_step_trains_on_train_batch_size_informative_groups(trainer):
    n, prompts = 4, 16
    batch, state = _first_batch(trainer)
    exp = trainer.make_experience(batch, state)
    after = trainer.train_loader.get_state()
    m = exp.metrics
    k = int(m["train/num_gen_batches"])
    assert k >= 2 and m["training/filter_groups/evicted_samples"] >= 1
    assert m["training/filter_groups/evicted_samples"] + m["training/filter_groups/kept_groups"] \
        == k * prompts
    assert m["training/filter_groups/kept_groups"] - \
        m["training/filter_groups/discarded_surplus_samples"] == prompts
    assert exp.scores.shape == (prompts * n,) and exp.advantages.shape[0] == prompts * n
    np.testing.assert_array_equal(exp.index, np.repeat(np.arange(prompts), n))
    raw = exp.scores - _penalty(exp.response_mask.sum(-1))  # acc: the unshaped score
    assert raw.reshape(prompts, n).std(1).min() > 0  # no group is all alike
    pos = lambda loader: loader["epoch"] * 4 + loader["step"]  # 4 batches an epoch
    assert pos(after) - pos(state.loader) == k - 1  # the extra batches came from the loader
    # deterministic: the same state and loader position make the same experience
    trainer.train_loader.set_state(state.loader)
    again = trainer.make_experience(batch, state)
    np.testing.assert_array_equal(again.seqs.input_ids, exp.seqs.input_ids)
    np.testing.assert_array_equal(again.scores, exp.scores)
    # the step records the loader after the extra batches (what a checkpoint saves)
    trainer.train_loader.set_state(state.loader)
    new, metrics = trainer.step(batch, state)
    assert new.loader == after and metrics["train/num_gen_batches"] == k
    assert np.isfinite(metrics["actor/pg_loss"]) and metrics["critic/score/mean"] == \
        pytest.approx(float(exp.scores.mean()), rel=1e-6)


def test_validation_at_n(trainer):
    out = trainer.validate()
    src = "val-core/synthetic/addition/reward"
    for name in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std"):
        assert np.isfinite(out[f"{src}/{name}"]), name
    for name in ("std@4", "worst@4/mean", "best@2/mean", "maj@2/mean"):
        assert f"val-aux/synthetic/addition/reward/{name}" in out, name
    assert "val-core/synthetic/addition/score/mean@4" not in out  # score is aux
    assert out[f"{src}/best@4/mean"] >= out[f"{src}/mean@4"] >= \
        out["val-aux/synthetic/addition/reward/worst@4/mean"]
    assert 1 <= out["val-aux/synthetic/addition/response_length/mean"] <= 4
    again = trainer.validate()  # same seed, same bootstrap: a resumed run logs these
    assert again.pop("timing_s/testing") > 0
    assert again == {k: v for k, v in out.items() if k != "timing_s/testing"}


@pytest.mark.slow
def test_dynamic_sampling_resumes_and_gives_up(tmp_path):
    """Two steps in one run equal step 1, a checkpoint, and step 2 resumed from it (the
    loader position saved after the extra batches); a reward that never differs within a
    group stops the run with the one-line error."""
    from rlhf_jax.trainer import train

    kw = _dapo_overrides(tmp_path, **{"trainer.save_freq": 1})
    whole = train(tiny(tmp_path / "a", "grpo_tiny_cpu.yaml", **kw))
    meta = json.loads((tmp_path / "a/run/checkpoints/1/meta/metadata").read_text())
    k1 = int(whole[0]["train/num_gen_batches"])
    assert meta["loader"]["epoch"] * 4 + meta["loader"]["step"] == k1  # 4 batches an epoch
    resumed = train(tiny(tmp_path / "b", "grpo_tiny_cpu.yaml", **kw, **{
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(tmp_path / "a/run/checkpoints/1")}))
    machine = ("timing_s/", "timing_per_token_ms/", "perf/")
    same = lambda m: {k: v for k, v in m.items() if not k.startswith(machine)}
    assert same(resumed[-1]).keys() == same(whole[-1]).keys()
    for key, value in same(whole[-1]).items():
        assert resumed[-1][key] == pytest.approx(value, abs=1e-5), key
    with pytest.raises(ConfigError, match="max_num_gen_batches: 4 generation batches kept 0"):
        train(tiny(tmp_path / "c", "grpo_tiny_cpu.yaml", **kw, **{
            "reward.custom_reward_function.name": "constant_score"}))
