"""The step contract: `make_experience -> learn`, sequences that carry their own layout, the
trainable part of the parameters, the run loop's hooks, every registered estimator end to
end."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny

from rlhf_jax import batching
from rlhf_jax import train_steps as ts
from rlhf_jax.core_algos import adv_estimator_names, get_adv_estimator
from rlhf_jax.hooks import HookList, StepInfo
from rlhf_jax.mesh import load_mesh_spec, make_mesh
from rlhf_jax.models import Model, ModelConfig
from rlhf_jax.trainer import Experience, Trainer

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _model_and_params(kind="lm", mesh_name="single"):
    spec = load_mesh_spec(mesh_name)
    mesh = make_mesh(spec)
    model = Model(CFG, kind=kind).with_layout(mesh, spec.train_rules)
    return model, model.init(jax.random.key(0), mesh, spec.train_rules)


@pytest.mark.parametrize("kind", ["lm", "value"])
def test_a_packed_row_gives_what_the_padded_rows_give(kind):
    """Two sequences packed in one row (positions restart, segments apart) get the same
    log-probs (values) as each in its own padded row: one code path, two layouts."""
    model, params = _model_and_params(kind)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 32, 9), rng.integers(0, 32, 6)  # prompt 4 + response 5 / 3 + 3
    # Padded: prompts left-padded to 4, responses right-padded to 5.
    ids = np.zeros((2, 9), np.int32)
    mask = np.zeros((2, 9), np.int32)
    ids[0], mask[0] = a, 1
    ids[1, 1:4], mask[1, 1:4] = b[:3], 1
    ids[1, 4:7], mask[1, 4:7] = b[3:], 1
    resp = ids[:, 4:]
    rmask = mask[:, 4:]
    padded = ts.Sequences.padded(ids, mask, resp, rmask)
    # Packed: [a | b | pad], targets = the row after its first token.
    row = np.concatenate([a, b, [0]]).astype(np.int32)[None]
    seg = np.array([[1] * 9 + [2] * 6 + [0]], np.int32)
    pos = np.array([list(range(9)) + list(range(6)) + [0]], np.int32)
    loss = np.zeros((1, 15), np.int32)
    loss[0, 3:8] = 1  # a's response tokens: positions 4..8 -> window index 3..7
    loss[0, 11:14] = 1  # b's: positions 12..14 -> 11..13
    packed = ts.Sequences(row, pos, seg, row[:, 1:], loss)

    def out(seqs):
        if kind == "lm":
            logits = ts.response_logits(model, params, seqs)
            logp = jax.nn.log_softmax(logits, -1)
            return np.asarray(jnp.take_along_axis(logp, seqs.targets[..., None], -1)[..., 0])
        return np.asarray(ts.response_values(model, params, seqs))

    got_padded, got_packed = out(padded), out(packed)[0]
    np.testing.assert_allclose(got_packed[3:8], got_padded[0][rmask[0] == 1], atol=1e-5)
    np.testing.assert_allclose(got_packed[11:14], got_padded[1][rmask[1] == 1], atol=1e-5)


def test_the_update_trains_only_the_trainable_part():
    """`Trainable`: a frozen subtree gets no optimizer state and stays bit for bit; the rest
    trains as it does when everything is trainable."""
    model, params = _model_and_params()
    frozen = lambda path: "embed_tokens" not in path
    trainable = ts.Trainable(frozen)
    optim = ts.OptimConfig(lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(1)
    n, p, r = 8, 4, 3
    ids = rng.integers(0, 32, (n, p + r)).astype(np.int32)
    seqs = ts.Sequences.padded(ids, np.ones_like(ids), ids[:, p:], np.ones((n, r), np.int32))
    plan = batching.Plan(n, n, 4)
    order = plan.order(0)
    old = np.full((n, r), -3.0, np.float32)
    adv = rng.normal(size=(n, r)).astype(np.float32)
    host = jax.tree.map(lambda x: x[order], (seqs, old, adv, old))
    batch = ts.ActorBatch(*host, jnp.asarray([n * r], jnp.float32), jnp.asarray([n], jnp.float32))
    step = jax.jit(functools.partial(ts.actor_update, model=model, loss=ts.ActorLoss(),
                                     optim=optim, trainable=trainable))
    state = ts.init_state(params, ts.make_optimizer(optim), trainable)
    n_opt = len(jax.tree.leaves(state.opt_state))
    n_all = len(jax.tree.leaves(ts.init_state(params, ts.make_optimizer(optim)).opt_state))
    assert n_opt < n_all
    new, metrics = step(state, batch)
    emb = ("model", "embed_tokens", "embedding")
    get = lambda tree: functools.reduce(lambda t, k: t[k], emb, tree)
    np.testing.assert_array_equal(np.asarray(get(new.params)), np.asarray(get(params)))
    q_old = params["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    q_new = new.params["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert float(jnp.max(jnp.abs(q_new - q_old))) > 0
    assert np.isfinite(float(metrics["actor/grad_norm"]))


def test_hooks_run_in_order_every_n_steps_and_at_the_end():
    calls = []

    def hook(name, **act):
        def fn(state, info):
            calls.append((name, info.step))
            for k, v in act.items():
                setattr(info, k, v)
            return state + 1
        return fn

    hooks = HookList()
    hooks.add("a", hook("a"))
    hooks.add("b", hook("b"), every=2)
    hooks.add("c", hook("c"), every=0, at_end=True)
    state = 0
    for step in (1, 2, 3):
        state = hooks.run(state, StepInfo(step, {}, final=step == 3))
    assert calls == [("a", 1), ("a", 2), ("b", 2), ("a", 3), ("c", 3)]
    assert state == 5
    calls.clear()
    stopper = HookList()
    stopper.add("stop", hook("stop", stop=True))
    stopper.add("save", hook("save"), every=10, at_end=True)  # an early stop is an end
    stopper.run(0, StepInfo(4, {}, final=False))
    assert calls == [("stop", 4), ("save", 4)]
    calls.clear()
    back = HookList()
    back.add("rollback", hook("rollback", rolled_back=True))
    back.add("log", hook("log"))  # a rolled-back step is not logged again
    back.run(0, StepInfo(1, {}, final=True))
    assert calls == [("rollback", 1)]


_FAST = {"mesh": "single", "trainer.sft_warmup.enable": False, "trainer.test_freq": -1,
         "trainer.rollback.enable": False, "data.train_batch_size": 8,
         "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_device": 8,
         "actor_rollout_ref.rollout.max_concurrent_decodes": 16}


def test_make_experience_reads_the_state_and_changes_nothing(tmp_path):
    """An asynchronous trainer may make step t+1's experience while step t learns: the
    experience depends only on (batch, state), and making it leaves the trainer as it was."""
    trainer = Trainer(tiny(tmp_path, **_FAST, **{"actor_rollout_ref.rollout.n": 2,
                                                 "actor_rollout_ref.actor.ppo_epochs": 1}))
    state = trainer.state._replace(step=1)
    batch = trainer.train_loader.batch_at(0, 0)
    before = jax.tree.map(np.asarray, trainer.state.actor.params)
    exp = trainer.make_experience(batch, state)
    again = trainer.make_experience(batch, state)
    assert isinstance(exp, Experience) and exp.advantages is None  # the fused critic's
    for field in ("scores", "rollout_log_probs", "old_log_probs", "ref_log_probs",
                  "token_rewards"):
        np.testing.assert_array_equal(np.asarray(getattr(exp, field)),
                                      np.asarray(getattr(again, field)), err_msg=field)
    chex_equal = jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), before,
                              trainer.state.actor.params)
    assert all(jax.tree.leaves(chex_equal)) and trainer.state.step == 0
    assert [s.name for s in trainer.stages] == ["old_log_prob", "ref", "adv"]
    new_state, metrics = trainer.learn(state, exp)
    assert new_state.step == 1 and np.isfinite(metrics["actor/pg_loss"])
    assert metrics["timing_s/gen"] > 0 and metrics["timing_s/update_actor"] > 0
    assert "critic/values/mean" in metrics  # the critic's update filled the values


# Those that need sum_pi_squared run in tests/test_sum_pi_squared.py; the estimators beyond
# the first six (the trainer's paths they take are the same) run with -m slow, and so does
# gae, which the default set trains in test_trainer.py and test_packing.py.
_FIRST_SIX = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
              "remax")


@pytest.mark.parametrize("estimator", [
    n if n in _FIRST_SIX else pytest.param(n, marks=pytest.mark.slow)
    for n in adv_estimator_names() if "sum_pi_squared" not in get_adv_estimator(n).needs])
def test_every_registered_estimator_trains_two_steps(tmp_path, estimator):
    needs_critic = estimator == "gae"
    profile = estimator == "grpo"  # one of them also traces step 2 (trainer.profile_steps)
    run = tiny(tmp_path, **_FAST, **{
        "algorithm.adv_estimator": estimator, "critic.enable": needs_critic,
        "actor_rollout_ref.rollout.n": 2, "trainer.total_training_steps": 2,
        "trainer.profile_steps": "[2]" if profile else "null"})
    trainer = Trainer(run)
    history = trainer.run()
    assert len(history) == 2 and trainer.global_step == 2
    if profile:
        assert list((tmp_path / "run/profile").rglob("*.xplane.pb"))
    for m in history:
        assert np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["critic/advantages/mean"])
    if estimator == "remax":
        assert history[-1]["timing_s/gen_max"] > 0  # the greedy baseline rollout
