"""Asynchronous training: the reward pool (row order, per-sample timeout, the failing sample
named as the inline path names it), the keys of the one-step-off mode, and its split mesh.
The trainer-level checks (equality with max_staleness 0, the reward overlap, SIGKILL and
resume) are in test_async_run.py (slow)."""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlhf_jax import roles
from rlhf_jax.config import load_config
from rlhf_jax.errors import ConfigError
from rlhf_jax.reward_pool import RewardPool
from rlhf_jax.rewards import RewardError, RewardInputs, score_batch_info
from rlhf_jax.rollout import reshard

MINIMAL = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=model"]


def _inputs(n: int) -> RewardInputs:
    return RewardInputs(["my/src"] * n, [f"answer {i}" for i in range(n)], list(range(n)),
                        [{"index": 100 + i} for i in range(n)], [f"f.parquet:{i // 2}"
                                                                 for i in range(n)],
                        np.full(n, 3))


def _score(i: int, delay: float = 0.0, raise_on: int | None = None):
    def fn(data_source, solution_str, ground_truth, extra_info):
        time.sleep(delay * (4 - ground_truth % 4))  # later rows finish first
        if ground_truth == raise_on:
            raise ZeroDivisionError("boom\nsecond line")
        return {"score": float(ground_truth) / 10, "pred": solution_str}
    return fn


def test_pool_returns_the_rows_in_order_as_inline_scoring_does():
    x, pool = _inputs(8), RewardPool(4)
    try:
        got = pool.submit(x, _score(0, delay=0.01)).result()
    finally:
        pool.close()
    want = score_batch_info(x.data_sources, x.responses, x.ground_truths, x.extra_infos,
                            custom_fn=_score(0), rows=x.rows)
    np.testing.assert_array_equal(got.scores, np.arange(8, dtype=np.float32) / 10)
    np.testing.assert_array_equal(got.scores, want.scores)
    assert got.info == want.info and got.info["pred"][5] == "answer 5"


def test_pool_names_a_failing_sample_with_the_inline_error():
    x, pool = _inputs(6), RewardPool(3)
    with pytest.raises(RewardError) as inline:
        score_batch_info(x.data_sources, x.responses, x.ground_truths, x.extra_infos,
                         custom_fn=_score(0, raise_on=3), rows=x.rows)
    try:
        with pytest.raises(RewardError) as pooled:
            pool.submit(x, _score(0, raise_on=3)).result()
    finally:
        pool.close()
    assert str(pooled.value) == str(inline.value) == (
        "the reward function raised on data_source 'my/src', response 3 of the batch, row "
        "f.parquet:1 (extra_info.index 103): ZeroDivisionError: boom")


def test_pool_timeout_names_the_sample_and_queueing_does_not_count():
    release = threading.Event()

    def stuck(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == 2:
            release.wait(30)
        return 1.0

    x, pool = _inputs(4), RewardPool(2, timeout_s=0.3)
    try:
        with pytest.raises(RewardError, match=r"^the reward function took more than "
                           r"reward.timeout_s=0.3s on data_source 'my/src', response 2 of "
                           r"the batch, row f.parquet:1 \(extra_info.index 102\)$"):
            pool.submit(x, stuck).result()
    finally:
        release.set()
        pool.close()
    # One worker, three samples of 0.2 s: 0.6 s in all, each within its 0.4 s.
    slow = lambda **kw: time.sleep(0.2) or 1.0
    pool = RewardPool(1, timeout_s=0.4)
    try:
        assert pool.submit(_inputs(3), slow).result().scores.tolist() == [1.0] * 3
    finally:
        pool.close()


@pytest.mark.parametrize("overrides, message", [
    (["reward.timeout_s=5"], "reward.timeout_s: bounds the reward pool's samples"),
    (["async_training.max_staleness=2"], "async_training.max_staleness: is read by the "
     "one-step-off mode only"),
    (["actor_rollout_ref.hybrid_engine=false", "algorithm.filter_groups.enable=true",
      "algorithm.filter_groups.metric=acc"], "dynamic sampling"),
    (["reward.num_workers=-1"], "reward.num_workers: must be >= 0"),
    (["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.model.lora_rank=8"],
     "with LoRA"),
])
def test_async_keys_take_effect_or_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*MINIMAL, *overrides])
    load_config(None, [*MINIMAL, "actor_rollout_ref.hybrid_engine=false",
                       "async_training.max_staleness=0", "reward.num_workers=4",
                       "reward.timeout_s=5"])


def test_several_hosts_need_a_split_each_host_can_take_a_share_of(monkeypatch):
    """(The split itself, on 2 processes: tests/test_distributed.py.)"""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="on several hosts needs a mesh preset with "
                       "rollout_sizes"):
        roles.build_mesh(load_config(None, [*MINIMAL, "actor_rollout_ref.hybrid_engine=false"]))
    roles.build_mesh(load_config(None, MINIMAL))  # the hybrid engine: as before
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    with pytest.raises(ConfigError, match=r"rollout's data size \(2\) must be multiples of "
                       "the host count"):
        roles.build_mesh(load_config(None, [*MINIMAL, "mesh=cpu-8-async",
                                            "actor_rollout_ref.hybrid_engine=false"]))


def test_the_split_mesh_trains_on_four_devices_and_generates_on_the_other_four():
    with pytest.raises(ConfigError, match="has rollout_sizes.*hybrid_engine=false"):
        roles.build_mesh(load_config(None, [*MINIMAL, "mesh=cpu-8-async"]))
    lay = roles.build_mesh(load_config(None, [*MINIMAL, "mesh=cpu-8-async",
                                              "actor_rollout_ref.hybrid_engine=false"]))
    ids = lambda mesh: sorted(d.id for d in mesh.devices.flat)
    assert ids(lay.mesh) == [0, 1, 2, 3] and ids(lay.gen_mesh) == [4, 5, 6, 7]
    x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8),
                       NamedSharding(lay.mesh, P("data", "fsdp")))
    tree = {"w": x, "b": x[0] * 2}
    gen = {"w": NamedSharding(lay.gen_mesh, P(None, "tensor")),
           "b": NamedSharding(lay.gen_mesh, P())}
    with jax.transfer_guard("disallow"):  # device to device, never through the host
        moved = reshard(tree, gen)
    for key in tree:
        assert {d.id for d in moved[key].sharding.device_set} == {4, 5, 6, 7}
        np.testing.assert_array_equal(np.asarray(tree[key]), np.asarray(moved[key]))
