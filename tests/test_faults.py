"""The fault catalogue: every failure a user can cause or suffer ends in one line
`error: ...` on stderr and exit status 2 from scripts/train.py, or in a recovery, and no
file written before the fault is lost or changed.

Most cases fail before anything compiles (config, data, tokenizer, model, reward file, run
directory) and run `scripts/train.py`'s `main()` in this process with its output captured:
the same code path as the script, without a jax start-up per case. The checkpoint cases
share one run directory whose checkpoints come from a real `Trainer` (no training step:
`start()` saves the rollback target, then the run state is saved as steps 1 and 2). The
disk-full cases use a small tmpfs when this process may mount one (root), else an injected
lack of space; the SIGTERM and kill cases run the script in subprocesses (`-m slow`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from tiny_run import ROOT, tiny, tiny_overrides

from rlhf_jax import checkpoint, preflight, tasks
from rlhf_jax.checkpoint import CheckpointWarning, DiskFull
from rlhf_jax.rewards import RewardError, score_batch_info

_spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts/train.py")
train_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_script)


@pytest.fixture(autouse=True)
def _no_precompile(monkeypatch):
    # The cases stop before the first step: nothing should compile behind them.
    monkeypatch.setenv("RLHF_JAX_PRECOMPILE", "0")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The addition task's parquet files, tokenizer and random-init model, written once."""
    root = tmp_path_factory.mktemp("fault_base")
    cfg = tiny(root)
    tasks.prepare(cfg)
    tasks.prepare_model(cfg)
    return root


def snapshot(*dirs: Path) -> dict[str, str]:
    return {str(p): hashlib.sha1(p.read_bytes()).hexdigest()
            for d in dirs if d.exists() for p in sorted(d.rglob("*")) if p.is_file()}


def assert_kept(before: dict[str, str]) -> None:
    """Every file of `before` is still there, byte for byte."""
    after = {p: hashlib.sha1(Path(p).read_bytes()).hexdigest()
             for p in before if Path(p).is_file()}
    assert after == before


def overrides(base: Path, run: Path, **extra) -> list[str]:
    return tiny_overrides(base, **{"mesh": "single", "synthetic.task": "null",
                                   "trainer.default_local_dir": str(run),
                                   "trainer.sft_warmup.enable": "false", **extra})


def main(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train_script.main(args)
    return rc, out.getvalue(), err.getvalue()


def one_error(rc: int, err: str) -> str:
    """The single `error:` line of a failed run (and no traceback)."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "unexpected" not in lines[0], lines[0]  # a known fault, not the catch-all
    return lines[0]


def fails(base: Path, tmp: Path, pattern: str, *extra: str, config: str = "ppo_tiny_cpu.yaml",
          **kw) -> str:
    """Runs train.py with the overrides; asserts one error line matching `pattern` and that
    the base files and anything in `tmp` are untouched."""
    before = snapshot(base, tmp)
    rc, _, err = main(["--config", str(ROOT / "configs" / config),
                       *overrides(base, tmp / "run", **kw), *extra])
    line = one_error(rc, err)
    assert re.search(pattern, line), line
    assert_kept(before)
    return err


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


def _model_copy(base: Path, tmp: Path) -> Path:
    dst = tmp / "model"
    shutil.copytree(base / "model", dst)
    return dst


# ----------------------------------------------------------------------- config and data

CONFIG_CASES = {
    "unknown key": (r"trainer\.nope", {"trainer.nope": 1}),
    "wrong type": (r"data\.train_batch_size", {"data.train_batch_size": "many"}),
    "bad choice": (r"algorithm\.kl_ctrl\.type: 'adaptiv' is not one of",
                   {"algorithm.kl_ctrl.type": "adaptiv"}),
    "impossible batch": (r"ppo_mini_batch_size",
                         {"actor_rollout_ref.actor.ppo_mini_batch_size": 32}),
    "out of range": (r"trainer\.rollback\.value_loss_floor",
                     {"trainer.rollback.value_loss_floor": -1}),
    "unknown mesh": (r"mesh", {"mesh": "no-such-mesh"}),
    "gae without a critic": (r"needs a critic", {"critic.enable": "false"}),
    "reward_fn_key refused": (r"data\.reward_fn_key", {"data.reward_fn_key": "other"}),
    "return_raw_chat refused": (r"data\.return_raw_chat", {"data.return_raw_chat": "true"}),
    "calculate_log_probs refused": (r"calculate_log_probs",
                                    {"actor_rollout_ref.rollout.calculate_log_probs": "false"}),
    "negative log_val_generations": (r"trainer\.log_val_generations: .*must be >= 0",
                                     {"trainer.log_val_generations": -1}),
    "resume_path not a step": (r"resume_from_path", {"trainer.resume_mode": "resume_path",
                                                     "trainer.resume_from_path": "/tmp"}),
    "wrong type in a nested key": (r"actor_rollout_ref\.actor\.optim\.lr: expected float",
                                   {"actor_rollout_ref.actor.optim.lr": "abc"}),
    "a section given a value": (r"trainer\.rollback: expected a mapping, got int 5",
                                {"trainer.rollback": 5}),
    "negative learning rate": (r"actor_rollout_ref\.actor\.optim\.lr: must be >= 0",
                               {"actor_rollout_ref.actor.optim.lr": -1e-3}),
    "an empty run directory": (r"trainer\.default_local_dir: must not be empty",
                               {"trainer.default_local_dir": "''"}),
    "an empty model path": (r"actor_rollout_ref\.model\.path: must not be empty",
                            {"actor_rollout_ref.model.path": "''"}),
    "mesh that cannot fit the devices": (r"mesh \(3, -1, 1\) cannot fit 8 devices",
                                         {"mesh": "{preset: cpu-8, data: 3, fsdp: -1, "
                                                  "tensor: 1}"}),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_faults(base, tmp_path, case):
    pattern, extra = CONFIG_CASES[case]
    fails(base, tmp_path, pattern, **extra)


def test_config_file_faults(base, tmp_path):
    rc, _, err = main(["--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml" in one_error(rc, err)
    for name, text, pattern in [
            ("bad.yaml", "data: [unclosed\n", r"bad\.yaml:2:1: invalid YAML"),
            ("tab.yaml", "data:\n\tseed: 1\n", r"tab\.yaml:2:1: invalid YAML.*'\\t'"),
            ("list.yaml", "- a\n- b\n", r"list\.yaml: the top level must be a mapping"),
            ("latin1.yaml", b"data:\n  seed: \xff\n", r"cannot read config file .*latin1")]:
        rc, _, err = main(["--config", str(_write(tmp_path / name, text))])
        assert re.search(pattern, one_error(rc, err)), (name, err)


@pytest.mark.parametrize("override, pattern", [
    ("trainer.total_training_steps", r"no '=' in override 'trainer\.total_training_steps'"),
    ("data.train_batch_size=[1,", r"cannot parse '\[1,' as YAML"),
])
def test_malformed_overrides(base, tmp_path, override, pattern):
    fails(base, tmp_path, pattern, override)


def test_a_mesh_file_that_is_not_yaml(base, tmp_path):
    mesh = _write(tmp_path / "mine.yaml", "sizes: {data: 2, fsdp: [1\n")
    fails(base, tmp_path, r"mine\.yaml:2:1: invalid YAML", mesh=str(mesh))
    _write(mesh, "sizes: [2, 2, 2]\n")
    fails(base, tmp_path, r"mine\.yaml: sizes must be a mapping of axis: size", mesh=str(mesh))


def test_resume_from_a_missing_path_creates_nothing(base, tmp_path):
    where = tmp_path / "nowhere/checkpoints/3"
    fails(base, tmp_path, r"trainer\.resume_from_path: .*nowhere/checkpoints/3 not found",
          **{"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(where)})
    assert not (tmp_path / "nowhere").exists()


DATA_CASES = {
    "train file missing": (r"data file not found",
                           lambda b, t: {"data.train_files": str(t / "x.parquet")}),
    "corrupt parquet": (r"cannot read parquet", lambda b, t: {
        "data.train_files": str(_write(t / "bad.parquet", b"PAR1 not parquet"))}),
    "no prompt column": (r"no column 'question'", lambda b, t: {"data.prompt_key": "question"}),
    "prompt too long": (r"row 0: prompt has 7 tokens, more than max_prompt_length 3",
                        lambda b, t: {"data.max_prompt_length": 3}),
    "fewer rows than a batch": (r"fewer than one batch", lambda b, t: {"data.train_batch_size": 128,
                                "actor_rollout_ref.actor.ppo_mini_batch_size": 64}),
    "val file missing": (r"data file not found",
                         lambda b, t: {"data.val_files": str(t / "v.parquet")}),
    "empty parquet file": (r"cannot read parquet .*size is 0 bytes", lambda b, t: {
        "data.train_files": str(_write(t / "empty.parquet", b""))}),
    "parquet without rows": (r"no usable rows in", lambda b, t: {
        "data.train_files": _rows(b, t, lambda tb: tb.slice(0, 0))}),
    "a prompt that is a string": (
        r"row 0: column 'prompt' must be a non-empty list of \{role, content\} messages, "
        r"got 'hello'", lambda b, t: {"data.train_files": _rows(b, t, lambda tb: _set(
            tb, "prompt", ["hello"] * tb.num_rows))}),
    "a message without content": (r"row 0: column 'prompt' must be a non-empty list",
                                  lambda b, t: {"data.train_files": _rows(b, t, lambda tb: _set(
                                      tb, "prompt", [[{"role": "user"}]] * tb.num_rows))}),
    "no reward_model column": (r"has no column 'reward_model'", lambda b, t: {
        "data.train_files": _rows(b, t, lambda tb: tb.drop(["reward_model"]))}),
    "a data_source no reward scores": (
        r"no reward function for data_source 'nobody/knows' \(row .*:0; registered: ",
        lambda b, t: {"data.train_files": _rows(b, t, lambda tb: _set(
            tb, "data_source", ["nobody/knows"] * tb.num_rows)),
            "reward.custom_reward_function.path": "null"}),
    "a directory for a data file": (r"data file not found: .*adir", lambda b, t: {
        "data.train_files": str(_mkdir(t / "adir"))}),
}


def _set(table, column: str, values: list):
    import pyarrow as pa

    return table.set_column(table.schema.get_field_index(column), column, pa.array(values))


def _rows(base: Path, tmp: Path, change) -> str:
    """The base train file changed by `change(table)`, written under tmp."""
    import pyarrow.parquet as pq

    path = tmp / "changed.parquet"
    pq.write_table(change(pq.read_table(base / "data/train.parquet")), path)
    return str(path)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_data_faults(base, tmp_path, case):
    pattern, extra = DATA_CASES[case]
    fails(base, tmp_path, pattern, **extra(base, tmp_path))


# -------------------------------------------------------------------- model and tokenizer

def _truncate_weights(model: Path) -> None:
    [f] = model.glob("*.safetensors")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garble_weights(model: Path) -> None:
    [f] = model.glob("*.safetensors")
    f.write_bytes(b"\xff" * 64)


def _no_config(model: Path) -> None:
    (model / "config.json").unlink()


def _unknown_family(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))


def _small_vocab(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": 8}))


def _corrupt_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").write_text('{"model": ')


def _word_level_tokenizer(model: Path) -> None:
    """A WordLevel tokenizer.json without an unk token: a word it lacks cannot be encoded."""
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if t not in "789"}
    tok["model"] = {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    (model / "tokenizer.json").write_text(json.dumps(tok))


def _no_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()


def _config_not_json(model: Path) -> None:
    (model / "config.json").write_text("{not json")


def _config_without(field: str):
    def damage(model: Path) -> None:
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                       if k != field}))
    return damage


def _wider_config(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))


def _no_weights(model: Path) -> None:
    [f] = model.glob("*.safetensors")
    f.unlink()


def _broken_chat_template(model: Path) -> None:
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in %}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))


MODEL_CASES = {
    "model path mistyped": (r"tokenizer directory not found: .*modle", None),
    "no tokenizer.json": (r"has no tokenizer\.json", _no_tokenizer),
    "config.json not JSON": (r"config\.json: invalid JSON at line 1", _config_not_json),
    "config.json without hidden_size": (r"config\.json: missing field 'hidden_size'",
                                        _config_without("hidden_size")),
    "config.json without model_type": (r"unsupported model_type None",
                                       _config_without("model_type")),
    "weights of another shape": (r"tensor '.*' has shape \(\d+,\), expected one that maps to",
                                 _wider_config),
    "a chat template that does not parse": (r"row 0: chat template failed", _broken_chat_template),
    "truncated safetensors": (r"model\.safetensors is truncated: \d+ bytes, its header needs",
                              _truncate_weights),
    "garbled safetensors": (r"is not a readable safetensors file", _garble_weights),
    "no config.json": (r"config\.json", _no_config),
    "unsupported family": (r"gpt_neox", _unknown_family),
    "tokenizer larger than the model": (r"has \d+ ids, more than the vocab_size 8", _small_vocab),
    "corrupt tokenizer.json": (r"cannot parse .*tokenizer\.json", _corrupt_tokenizer),
    "tokenizer.json that does not fit": (r"cannot encode", _word_level_tokenizer),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_and_tokenizer_faults(base, tmp_path, case):
    pattern, damage = MODEL_CASES[case]
    if damage is None:
        model = tmp_path / "modle"
    else:
        model = _model_copy(base, tmp_path)
        damage(model)
    fails(base, tmp_path, pattern, **{"actor_rollout_ref.model.path": str(model)})


def test_synthetic_task_writes_a_model_only_where_it_says(base, tmp_path):
    """A mistyped model path with the task on: a directory of other files is refused; a new
    one gets the task's model, and the run says so once."""
    other = _write(tmp_path / "mine" / "notes.txt", "my files").parent
    fails(base, tmp_path, r"holds other files \(notes\.txt\) but no config\.json.*mistyped",
          **{"synthetic.task": "addition", "actor_rollout_ref.model.path": str(other)})
    cfg = tiny(tmp_path, **{"actor_rollout_ref.model.path": str(tmp_path / "new"),
                            "data.train_files": str(base / "data/train.parquet"),
                            "data.val_files": str(base / "data/val.parquet")})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tasks.prepare(cfg)
        tasks.prepare_model(cfg)
        tasks.prepare(cfg)
        tasks.prepare_model(cfg)
    assert out.getvalue().count("writing a random-init one there") == 1
    assert out.getvalue().count("synthetic.task addition: wrote") == 1


# --------------------------------------------------------------------------------- rewards

def test_custom_reward_file_faults(base, tmp_path):
    key = "reward.custom_reward_function.path"
    fails(base, tmp_path, r"custom reward file not found", **{key: str(tmp_path / "none.py")})
    syntax = _write(tmp_path / "syntax.py", "def compute_score(:\n")
    fails(base, tmp_path, r"syntax\.py line 1 cannot be imported: SyntaxError",
          **{key: str(syntax)})
    top = _write(tmp_path / "top.py", "import no_such_module_here\n")
    fails(base, tmp_path, r"top\.py cannot be imported: ModuleNotFoundError", **{key: str(top)})
    empty = _write(tmp_path / "empty.py", "x = 1\n")
    fails(base, tmp_path, r"has no function 'compute_score'", **{key: str(empty)})


@pytest.mark.parametrize("result, pattern", [
    (RuntimeError("boom"), r"raised on data_source 'src/b', response 1 of the batch, row "
                           r"a\.parquet:5 \(extra_info.index 7\): RuntimeError: boom"),
    (float("nan"), r"returned nan on data_source 'src/b', response 1"),
    ("great", r"returned 'great' on data_source 'src/b', response 1 .*want a float"),
])
def test_reward_function_faults_name_the_row(result, pattern):
    def fn(data_source, solution_str, ground_truth, extra_info):
        if data_source == "src/b":
            if isinstance(result, Exception):
                raise result
            return result
        return 1.0

    with pytest.raises(RewardError, match=pattern):
        score_batch_info(["src/a", "src/b"], ["x", "y"], ["1", "2"], [None, {"index": 7}],
                         custom_fn=fn, rows=["a.parquet:0", "a.parquet:5"])


# -------------------------------------------------------------- run directory, degenerate

def test_a_file_where_the_checkpoints_go(base, tmp_path):
    """Refused before orbax starts its threads (whose traceback would follow the line)."""
    run = tmp_path / "run"
    _write(run / "checkpoints", "x")
    fails(base, tmp_path, r"run/checkpoints is a file, not a checkpoint directory",
          **{"trainer.default_local_dir": str(run)})


def test_run_directory_faults(base, tmp_path):
    fails(base, tmp_path, r"trainer\.default_local_dir: cannot create /proc/none/run",
          **{"trainer.default_local_dir": "/proc/none/run"})
    afile = _write(tmp_path / "afile", "x")
    fails(base, tmp_path, r"trainer\.default_local_dir: cannot create .*afile",
          **{"trainer.default_local_dir": str(afile / "run")})


def test_a_second_run_on_the_same_directory_refuses(base, tmp_path):
    cfg = tiny(base, **{"mesh": "single", "trainer.default_local_dir": str(tmp_path / "run")})
    with preflight.RunLock(cfg):
        fails(base, tmp_path, r"is in use by another run \(pid \d+, lock .*run\.lock\)")
    with preflight.RunLock(cfg):  # released when the first run ends
        pass


def test_degenerate_configs_are_warned_about_once(base, tmp_path):
    """GRPO with one response per prompt, zero learning rates: one warning line each, before
    the run starts (here it then stops on a missing reward file, before compiling)."""
    err = fails(base, tmp_path, r"custom reward file not found", config="grpo_tiny_cpu.yaml",
                **{"actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.actor.optim.lr": 0,
                   "reward.custom_reward_function.path": str(tmp_path / "none.py")})
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 2, err
    assert "rollout.n is 1: every advantage is 0" in warned[0]
    assert "actor_rollout_ref.actor.optim.lr is 0" in warned[1]
    cfg = tiny(base, **{"critic.optim.lr": 0})
    assert preflight.degenerate(cfg) == ["critic.optim.lr is 0: the critic does not learn"]


def test_a_model_without_weights_is_warned_about(base, tmp_path):
    """config.json but no safetensors: random weights (the PPO benchmark's model directory
    does so on purpose), said once before the run starts (here it then stops on a missing
    reward file, before compiling)."""
    model = _model_copy(base, tmp_path)
    _no_weights(model)
    err = fails(base, tmp_path, r"custom reward file not found",
                **{"actor_rollout_ref.model.path": str(model),
                   "reward.custom_reward_function.path": str(tmp_path / "none.py")})
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and re.search(r"model\.path .*/model has a config\.json but no "
                                          r"\*\.safetensors weights", warned[0]), err


# ---------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def ckpt_run(base, tmp_path_factory):
    """A run directory with good checkpoints at steps 0, 1 and 2 of a PPO run with a critic
    (a real run state; no step trained); step 2's run had rolled back twice."""
    from rlhf_jax.trainer import Trainer

    run = tmp_path_factory.mktemp("fault_ckpt") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_JAX_PRECOMPILE", "0")
        trainer = Trainer(tiny(base, **{"mesh": "single", "trainer.default_local_dir": str(run),
                                        "trainer.sft_warmup.enable": "false"}))
    trainer.start()
    for step in (1, 2):
        trainer.recovery.save(trainer.state._replace(step=step, rollbacks=2 * (step == 2)))
    trainer.checkpointer.close()
    return run


def test_resume_into_another_configuration_says_what_differs(base, tmp_path, ckpt_run):
    run = shutil.copytree(ckpt_run, tmp_path / "run")
    err = fails(base, tmp_path / "other", r"holds checkpoints of another configuration "
                r"\(.*critic\.enable: True -> False.*\); resume with that configuration",
                config="grpo_tiny_cpu.yaml", **{"trainer.default_local_dir": str(run)})
    assert re.search(r"; and \d+ more\)", err)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0", "1", "2"]


def test_damaged_newest_checkpoint_falls_back_and_says_so(base, tmp_path, ckpt_run):
    from rlhf_jax.trainer import Trainer

    run = shutil.copytree(ckpt_run, tmp_path / "run")
    biggest = max((run / "checkpoints/2").rglob("*"), key=lambda p: p.stat().st_size
                  if p.is_file() else 0)
    biggest.write_bytes(biggest.read_bytes()[:10])
    trainer = Trainer(tiny(base, **{"mesh": "single", "trainer.default_local_dir": str(run),
                                    "trainer.sft_warmup.enable": "false"}))
    with pytest.warns(CheckpointWarning, match=r"checkpoint step 2 .* is damaged .*; "
                                               r"restored step 1"):
        state, origin = trainer.recovery.restore(trainer.state)
    trainer.checkpointer.close()
    assert state.step == 1 and origin.endswith("checkpoints/1")


def test_a_resumed_run_keeps_its_rollback_count(base, tmp_path, ckpt_run):
    """The rollback count is part of the run state: resumed after 2 rollbacks, a run with
    max_rollbacks 2 stops at its next one instead of starting the count again."""
    from rlhf_jax.rollback import RollbackLimit
    from rlhf_jax.trainer import Trainer

    run = shutil.copytree(ckpt_run, tmp_path / "run")
    trainer = Trainer(tiny(base, **{"mesh": "single", "trainer.default_local_dir": str(run),
                                    "trainer.sft_warmup.enable": "false",
                                    "trainer.rollback.max_rollbacks": 2}))
    state, _ = trainer.recovery.restore(trainer.state)
    assert (state.step, state.rollbacks) == (2, 2)
    with pytest.raises(RollbackLimit, match=r"step 2: spike; stopping after "
                                            r"trainer.rollback.max_rollbacks=2 rollbacks"):
        trainer.recovery.roll_back(state, "spike")
    trainer.checkpointer.close()


@contextlib.contextmanager
def small_disk(tmp: Path, size: str):
    """A tmpfs of `size` at tmp/disk when this process may mount one; else None."""
    disk = tmp / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    try:
        yield disk if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def _state(mib: float):
    rng = np.random.default_rng(0)  # incompressible, as trained weights are
    return {"w": rng.random(int(mib * 2**20 / 4), np.float32)}


@pytest.mark.parametrize("when", ["before the save", "while writing"])
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, when):
    """A 6 MiB disk holds the 2 MiB step 1 but not the 5 MiB step 2: one `DiskFull` naming the
    space needed, and step 1 restores intact. "while writing": the check before the save is
    passed over, so the write itself runs out of space (ENOSPC from tensorstore)."""
    with small_disk(tmp_path, "6m") as disk:
        if disk is None:  # not root: the lack of space is injected
            disk = tmp_path / "disk"
            total = shutil.disk_usage(disk)
            monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                                lambda p: total._replace(free=4 * 2**20))
        ckpt = checkpoint.Checkpointer(disk / "checkpoints")
        ckpt.save(1, _state(2), {"good": True})
        ckpt.wait()
        if when == "while writing":
            monkeypatch.setattr(ckpt, "_check_space", lambda *a: setattr(ckpt, "_need", 5 << 20))
            if shutil.disk_usage(disk).total > 64 << 20:  # injected: orbax's write fails
                def no_space():
                    raise OSError(28, "No space left on device")
                monkeypatch.setattr(ckpt._mgr, "wait_until_finished", no_space)
        with pytest.raises(DiskFull, match=r"checkpoint.* needs about \d\.\d MiB.* intact "
                                           r"\(steps 1\)"):
            ckpt.save(2, _state(5), {"good": True})
            ckpt.wait()
        monkeypatch.undo()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            got = ckpt.restore_latest_good(target_state=_abstract_like(_state(2)))
        assert got.step == 1
        assert (np.asarray(got.state["w"]) == _state(2)["w"]).all()
        ckpt.close()


def _abstract_like(tree):
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


# ------------------------------------------------------------------ slow: signals, chaos

@pytest.mark.slow
def test_sigterm_during_a_save_stops_with_one_line_and_resumes(base, tmp_path):
    """SIGTERM while a checkpoint is being written: one error line, exit 2; the next run
    resumes from a complete checkpoint and ends where an uninterrupted run ends."""
    import signal
    import time

    from tiny_run import steps_logged
    from tiny_run import train_script as popen

    args = ["--config", str(ROOT / "configs/ppo_tiny_cpu.yaml"),
            *overrides(base, tmp_path / "run", **{"trainer.total_training_steps": 4,
                                                   "trainer.save_freq": 1})]
    proc = popen(args, tmp_path)
    deadline = time.time() + 600
    ckpts = tmp_path / "run/checkpoints"
    while time.time() < deadline and not any(ckpts.glob("2*")):  # step 2's save started
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 2
    log = (tmp_path / "stdout.txt").read_text()
    assert "Traceback" not in log
    assert len(re.findall(r"^error: stopped by SIGTERM", log, re.M)) == 1, log
    assert popen(args, tmp_path).wait(timeout=600) == 0
    assert "resumed from" in (tmp_path / "stdout.txt").read_text()
    assert max(steps_logged(tmp_path / "run")) == 4
    ok = tempfile.mkdtemp(dir=tmp_path)
    assert popen([*args, f"trainer.default_local_dir={ok}/run"], Path(ok)).wait(timeout=600) == 0
    got, want = steps_logged(tmp_path / "run"), steps_logged(Path(ok) / "run")
    from tiny_run import algorithmic, compare

    compare(algorithmic([got[s] for s in sorted(want)]), algorithmic(list(want.values())),
            atol=1e-5)


# 48 rows / 16 a batch: 3 steps an epoch; a checkpoint every step. max_kl 0.06: the seeded
# run's KL in the reward passes it at step 7 (0.062), which rolls back (to step 5) and halves
# the learning rates; the run then ends at step 8.
CHAOS = {"mesh": "single", "synthetic.num_train": 48, "trainer.total_training_steps": 8,
         "trainer.save_freq": 1, "trainer.test_freq": 4, "trainer.rollback.max_kl": 0.06}


def _logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("training/global_step", 0)
             for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


@pytest.mark.slow  # seven training processes: ~5 minutes on 2 cores
def test_chaos_five_sigkills_at_random_moments_change_no_metric(tmp_path):
    """SIGKILL 5 times, each at a seeded random moment: once the run has logged a seeded
    number of further steps, after a seeded fraction of a second (so a kill lands in a step,
    a save or a restart alike). Started again each time with the same command, the run logs
    the same metrics, step for step, as one never killed, across the epoch boundaries and
    the rollback at step 7."""
    import os
    import random
    import signal
    import time

    from tiny_run import algorithmic, compare, steps_logged
    from tiny_run import train_script as popen

    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    for d in (ref_dir, cut_dir):
        d.mkdir()
    ref = popen(tiny_overrides(ref_dir, **CHAOS), ref_dir)
    assert ref.wait(timeout=1800) == 0, (ref_dir / "stdout.txt").read_text()[-3000:]
    rng, kills = random.Random(24), 0
    while kills < 5:
        proc = popen(tiny_overrides(cut_dir, **CHAOS), cut_dir)
        target = min(_logged_steps(cut_dir / "run") + rng.randint(0, 2), 7)
        deadline = time.monotonic() + 1200
        while proc.poll() is None and _logged_steps(cut_dir / "run") < target:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
            kills += 1
        else:
            assert proc.returncode == 0
            shutil.rmtree(cut_dir / "run")  # it ended before the kill: start over
    last = popen(tiny_overrides(cut_dir, **CHAOS), cut_dir)
    assert last.wait(timeout=1800) == 0, (cut_dir / "stdout.txt").read_text()[-3000:]
    want, got = steps_logged(ref_dir / "run"), steps_logged(cut_dir / "run")
    assert sorted(want) == sorted(got) == list(range(1, 9))
    compare(algorithmic([got[s] for s in range(1, 9)]), algorithmic([want[s] for s in
                                                                        range(1, 9)]), atol=0)
    assert [got[s]["training/epoch"] for s in (3, 4, 6, 7)] == [0.0, 1.0, 1.0, 2.0]
    events = [r for r in (json.loads(line) for line in
                          (ref_dir / "run/metrics.jsonl").read_text().splitlines())
              if r.get("event") == "training/rollbacks"]
    assert events and events[0]["failed_step"] == 7 and events[0]["restored_step"] == 5
    stdout = (cut_dir / "stdout.txt").read_text()
    # Kills that land while a restart imports jax leave no line and no resume; how many do
    # depends on the machine's speed (3 of the 5 on an idle Intel host), so at least two
    # resumes from a mid-run checkpoint are asked for, not more.
    assert "Traceback" not in stdout and stdout.count("resumed from") >= 2


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    """Killed in the middle of writing a metrics row: the resumed run cuts the torn line off
    and every earlier row stays as it was."""
    from rlhf_jax.trackers import JsonlTracker

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"training/global_step": 1, "a": 1}\n{"training/global_st')
    tracker = JsonlTracker(tmp_path)
    tracker.log_metrics({"a": 2.0}, 2)
    tracker.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"training/global_step": 1, "a": 1}, {"training/global_step": 2, "a": 2.0}]


def test_log_val_generations_picks_as_verl_does():
    """Sorted by input, shuffled by RandomState(42), the first n (verl's
    `_maybe_log_val_generations`), whatever order the samples came in."""
    from rlhf_jax.validation import pick_generations

    samples = [(f"q{i}", f"a{i}", i / 10) for i in range(10)]
    want = sorted(samples)
    np.random.RandomState(42).shuffle(want)
    got = pick_generations(samples[::-1], 3)
    assert got == [{"input": i, "output": o, "score": s} for i, o, s in want[:3]]


def test_an_unforeseen_error_is_one_line_naming_its_traceback_file(monkeypatch):
    """A bug, not a bad input: still one line and exit 2, and the traceback kept in a file."""
    def broken(*args):
        raise KeyError("internal")

    monkeypatch.setattr(train_script, "load_config", broken)
    rc, _, err = main([])
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    found = re.search(r"^error: unexpected KeyError: 'internal' \(a bug; traceback in (\S+)\)$",
                      err.strip())
    assert found, err
    text = Path(found[1]).read_text()
    Path(found[1]).unlink()
    assert text.startswith("Traceback") and "in broken" in text


def test_sigterm_waits_until_orbax_has_started_a_save():
    """Raised inside orbax's save, train.py's SIGTERM exception would leave its threads
    half-way (and a traceback at exit): it is held until the save has started."""
    import os
    import signal

    from rlhf_jax.errors import Interrupted

    previous = signal.signal(signal.SIGTERM, train_script._interrupt)
    inside = []
    try:
        with pytest.raises(Interrupted, match="stopped by SIGTERM"):
            with checkpoint.signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                inside.append("still saving")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert inside == ["still saving"]


def test_sigterm_during_a_checkpoint_hook_waits_for_the_steps_metrics():
    """The run loop holds SIGTERM from the checkpoint hook to the step's last hook: a run
    stopped while its checkpoint is written has logged that step (it resumes from it)."""
    import os
    import signal

    from rlhf_jax.errors import Interrupted
    from rlhf_jax.hooks import HookList, StepInfo

    ran = []

    def hook(name, kill=False):
        def fn(state, info):
            if kill:
                os.kill(os.getpid(), signal.SIGTERM)
            ran.append(name)
            return state
        return fn

    hooks = HookList()
    hooks.add("validation", hook("validation"))
    hooks.add("checkpoint", hook("checkpoint", kill=True), held=True)
    hooks.add("trackers", hook("trackers"))
    previous = signal.signal(signal.SIGTERM, train_script._interrupt)
    try:
        with pytest.raises(Interrupted, match="stopped by SIGTERM"):
            hooks.run(None, StepInfo(step=1, metrics={}, final=False))
        assert ran == ["validation", "checkpoint", "trackers"]
        ran.clear()  # before the held hooks, SIGTERM stops at once
        hooks.hooks[0] = dataclasses.replace(hooks.hooks[0], fn=hook("validation", kill=True))
        with pytest.raises(Interrupted):
            hooks.run(None, StepInfo(step=2, metrics={}, final=False))
        assert ran == []
    finally:
        signal.signal(signal.SIGTERM, previous)
