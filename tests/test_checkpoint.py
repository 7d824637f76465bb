"""Checkpointer: round trip across meshes, good/bad selection, damaged-checkpoint fallback."""

import shutil
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlhf_jax.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    DamagedCheckpoint,
)


class Toy(NamedTuple):
    params: dict
    opt_state: tuple
    kl_coef: jax.Array
    rng: jax.Array


def mesh(shape):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), ("data", "fsdp", "tensor"))


def shardings_for(tree, m):
    """Params-like 2-D leaves over (fsdp, tensor), 1-D over tensor, scalars replicated."""
    specs = {2: P("fsdp", "tensor"), 1: P("tensor")}
    return jax.tree.map(lambda x: NamedSharding(m, specs.get(np.ndim(x), P())), tree)


def make_state(m, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(128, 64)).astype(np.float32),
              "b": rng.normal(size=(8,)).astype(np.float32)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = Toy(params, tx.init(params), np.float32(0.05 + seed),
                jax.random.key_data(jax.random.key(seed)))
    return jax.device_put(state, shardings_for(state, m))


def meta(step, good=True):
    return {"step": step, "epoch": 0, "good": good, "data": {"epoch": 0, "index": step},
            "config": {"trainer": {"save_freq": 10}}, "rollbacks": 0}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Steps 10 and 20 (both good) saved on a (2,2,2) mesh."""
    d = tmp_path_factory.mktemp("ckpt") / "base"
    m = mesh((2, 2, 2))
    states = {s: make_state(m, seed=s) for s in (10, 20)}
    with Checkpointer(d) as ck:
        for s, st in states.items():
            ck.save(s, st, meta(s))
    return d, states


def copy_of(base, tmp_path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(base[0], d)
    return d


@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 1, 1)])
def test_restore_onto_another_mesh(base, shape):
    d, states = base
    m = mesh(shape)
    target = abstract(states[20])
    with Checkpointer(d) as ck:
        assert ck.all_steps() == [10, 20] and ck.latest_step() == 20
        step, state, got_meta = ck.restore(target_state=target,
                                           shardings=shardings_for(target, m))
    assert step == 20 and got_meta == meta(20)
    assert isinstance(state, Toy) and isinstance(state.opt_state[1][0], optax.ScaleByAdamState)
    assert_same(state, states[20])
    assert state.params["w"].sharding == NamedSharding(m, P("fsdp", "tensor"))
    assert state.rng.dtype == np.uint32 and state.kl_coef.sharding.mesh.shape == m.shape


def test_save_copies_off_device_so_donation_is_safe(tmp_path):
    m = mesh((2, 2, 2))
    state = make_state(m, seed=3)
    expected = jax.tree.map(np.asarray, state)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(5, state, meta(5))
        for x in jax.tree.leaves(state):  # what donation to the next train step does
            x.delete()
        ck.wait()
        assert (tmp_path / "ck" / "5" / MANIFEST).is_file()
        _, restored, _ = ck.restore(5, target_state=abstract(expected),
                                    shardings=shardings_for(expected, m))
    assert_same(restored, expected)


def test_save_compiles_no_slices_and_reads_replica_parallel_saves(tmp_path):
    """One process writes replicated shards whole: no eager `slice` program per array (a
    shape no other test saves, so nothing is in jit's cache); a checkpoint written with
    orbax's replica-parallel default (earlier versions) restores the same."""
    import orbax.checkpoint as ocp

    from rlhf_jax.compile_cache import CompileLog

    m = mesh((2, 2, 2))
    rng = np.random.default_rng(7)
    state = {"w": rng.normal(size=(24, 40)).astype(np.float32),
             "v": rng.normal(size=(40, 24)).astype(np.float32), "s": np.float32(3.0)}
    state = jax.device_put(state, shardings_for(state, m))
    with CompileLog() as log, Checkpointer(tmp_path / "new") as ck:
        ck.save(1, state, meta(1))
    assert "slice" not in log.per_program(), log.per_program()
    default = ocp.type_handlers.get_type_handler(jax.Array)
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=True), override=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = ocp.CheckpointManager(tmp_path / "old", item_names=("state", "meta"))
            ck.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               meta=ocp.args.JsonSave(meta(1))))
            ck.wait_until_finished()
            ck.close()
    finally:
        ocp.type_handlers.register_type_handler(jax.Array, default, override=True)
    with Checkpointer(tmp_path / "old") as ck:
        _, restored, _ = ck.restore(1, target_state=abstract(state),
                                    shardings=shardings_for(state, m))
    assert_same(restored, state)


def test_latest_good_skips_bad_checkpoint_and_force_replaces_it(tmp_path):
    m = mesh((2, 2, 2))
    state = make_state(m)
    target, sh = abstract(state), shardings_for(state, m)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        assert ck.restore_latest_good(target_state=target, shardings=sh) is None
        with pytest.raises(CheckpointError, match="no checkpoint"):
            ck.restore(target_state=target, shardings=sh)
        ck.save(10, state, meta(10))
        ck.save(20, state, meta(20, good=False))  # saved while a rollback trigger fired
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a bad checkpoint is no damage: no warning
            got = ck.restore_latest_good(target_state=target, shardings=sh)
        assert got.step == 10 and got.meta["good"]
        assert [(s.step, s.damaged) for s in got.skipped] == [(20, False)]
        with pytest.raises(CheckpointError, match="already exists"):
            ck.save(20, state, meta(20))
        ck.save(20, state, meta(20), force=True)  # re-reached after the rollback
        assert ck.restore_latest_good(target_state=target, shardings=sh).step == 20
        with pytest.raises(CheckpointError, match="'good'"):
            ck.save(30, state, {"step": 30})


def _largest_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST]
    largest = max(files, key=lambda p: p.stat().st_size)
    assert largest.parent.name == "d", largest  # array data (OCDBT), not orbax metadata
    return largest


def _truncate_largest(step_dir):
    p = _largest_file(step_dir)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)


def _truncate_largest_no_manifest(step_dir):
    (step_dir / MANIFEST).unlink()  # orbax alone must notice too
    _truncate_largest(step_dir)


DAMAGE = {
    "truncate_largest": _truncate_largest,
    "truncate_largest_no_manifest": _truncate_largest_no_manifest,
    "delete_state_metadata": lambda d: (d / "state" / "_METADATA").unlink(),
    "truncate_sharding_file": lambda d: (d / "state" / "_sharding").write_text("{"),
    "delete_meta": lambda d: (d / "meta" / "metadata").unlink(),
    "garble_meta": lambda d: (d / "meta" / "metadata").write_text('{"good": tr'),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_falls_back_with_one_warning(base, tmp_path, damage):
    d = copy_of(base, tmp_path)
    DAMAGE[damage](d / "20")
    m = mesh((1, 8, 1))
    target = abstract(base[1][10])
    with Checkpointer(d) as ck:
        with pytest.raises(DamagedCheckpoint, match="step 20"):
            ck.restore(20, target_state=target, shardings=shardings_for(target, m))
        with pytest.warns(CheckpointWarning) as record:
            got = ck.restore_latest_good(target_state=target, shardings=shardings_for(target, m))
    assert got.step == 10
    assert_same(got.state, base[1][10])
    assert [(s.step, s.damaged) for s in got.skipped] == [(20, True)]
    (line,) = [str(w.message) for w in record]
    assert "step 20" in line and "step 10" in line and str(d / "20") in line
    assert "\n" not in line


def test_unfinished_save_is_ignored_and_all_damaged_raises(base, tmp_path):
    d = copy_of(base, tmp_path)
    tmp = d / "30.orbax-checkpoint-tmp-1234"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "partial").write_bytes(b"\0" * 10)
    with pytest.warns(CheckpointWarning, match="partly written"):
        ck = Checkpointer(d)
    target = abstract(base[1][10])
    sh = shardings_for(target, mesh((1, 1, 1)))
    try:
        assert ck.all_steps() == [10, 20]  # orbax removes the tmp dir at the next save
        for s in (10, 20):
            _truncate_largest(d / str(s))
        with pytest.raises(CheckpointError, match="no good, intact checkpoint"):
            ck.restore_latest_good(target_state=target, shardings=sh)
    finally:
        ck.close()


def test_max_to_keep_keeps_newest_good(tmp_path):
    m = mesh((1, 1, 1))
    state = make_state(m)
    with Checkpointer(tmp_path / "ck", max_to_keep=1) as ck:
        ck.save(1, state, meta(1))
        ck.save(2, state, meta(2, good=False))
        ck.save(3, state, meta(3, good=False))
        ck.wait()
        assert ck.all_steps() == [1, 3]
        got = ck.restore_latest_good(target_state=abstract(state),
                                     shardings=shardings_for(state, m))
    assert got.step == 1
