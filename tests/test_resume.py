"""Checkpoints in the trainer: a run killed with SIGKILL and resumed equals one never killed,
also when it resumes at an epoch boundary; damaged newest checkpoints fall back."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_run import MACHINE, ROOT, steps_logged, tiny_overrides, train_script

# 48 rows / 16 per batch: 3 steps an epoch. Checkpoints at 2 (mid epoch 0), 4 (mid epoch 1),
# 6 (the end of epoch 1) and 8.
RUN = {"mesh": "single", "synthetic.num_train": 48, "trainer.total_training_steps": 8,
       "trainer.save_freq": 2, "trainer.test_freq": 4}


def _manifest(run: Path, step: int) -> Path:
    return run / "checkpoints" / str(step) / "rlhf_manifest.json"


def _kill_after(proc, path: Path, timeout: float = 600) -> None:
    """SIGKILLs `proc` as soon as `path` exists (the checkpoint is whole on disk)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {path}"
        assert time.monotonic() < deadline, f"no {path} after {timeout}s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def _resumed_steps(stdout: str) -> list[int]:
    return [int(line.split(" at step ")[1].split()[0]) for line in stdout.splitlines()
            if line.startswith("resumed from ")]


def reference_run(tmp_path: Path, run: dict) -> tuple[Path, Path]:
    """`(ref_dir, cut_dir)`: the run `run` trained uninterrupted in ref_dir; cut_dir empty."""
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    for d in (ref_dir, cut_dir):
        d.mkdir()
    ref = train_script(tiny_overrides(ref_dir, **run), cwd=ref_dir)
    assert ref.wait(timeout=900) == 0, (ref_dir / "stdout.txt").read_text()[-3000:]
    return ref_dir, cut_dir


@pytest.mark.slow  # four training processes: ~3 minutes on 2 cores
def test_sigkill_and_resume_equals_uninterrupted_run(tmp_path):
    ref_dir, cut_dir = reference_run(tmp_path, RUN)
    _kill_after(train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir),
                _manifest(cut_dir / "run", 2))
    _kill_after(train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir),
                _manifest(cut_dir / "run", 6))
    last = train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir)
    assert last.wait(timeout=900) == 0, (cut_dir / "stdout.txt").read_text()[-3000:]

    stdout = (cut_dir / "stdout.txt").read_text()
    resumed = _resumed_steps(stdout)
    # The kill lands at most a step after the checkpoint; the next one is two steps on.
    assert len(resumed) == 2 and resumed[0] == 2 and resumed[1] == 6, stdout[-3000:]
    want, got = steps_logged(ref_dir / "run"), steps_logged(cut_dir / "run")
    assert sorted(want) == sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        a = {k: v for k, v in want[step].items() if not k.startswith(MACHINE)}
        b = {k: v for k, v in got[step].items() if not k.startswith(MACHINE)}
        assert a.keys() == b.keys(), step
        assert a == b, (step, {k: (a[k], b[k]) for k in a if a[k] != b[k]})
    # Resumed exactly at the end of epoch 1, the run trained epoch 2 (verl trained 0 steps).
    assert [got[s]["training/epoch"] for s in (6, 7, 8)] == [1.0, 2.0, 2.0]


def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    from tiny_run import tiny

    from rlhf_jax.trainer import Trainer

    cfg = tiny(tmp_path, **{**RUN, "trainer.total_training_steps": 4})
    trained = Trainer(cfg)
    trained.run()
    newest = tmp_path / "run/checkpoints/4"
    _check_export(trained, newest, tmp_path / "hf")
    biggest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    # A run directory exports its newest intact step, as the resume below restores it.
    from rlhf_jax.export import export_hf

    with pytest.warns(UserWarning, match=r"checkpoint step 4 .* is damaged .*restored step 2"):
        assert export_hf(tmp_path / "run", tmp_path / "hf2")[1] == 2
    trainer = Trainer(tiny(tmp_path, **{**RUN, "trainer.total_training_steps": 5}))
    with pytest.warns(UserWarning, match=r"checkpoint step 4 .* is damaged .*restored step 2"):
        history = trainer.run()
    assert [round(m["training/epoch"]) for m in history] == [0, 1, 1]  # steps 3, 4, 5


def _check_export(trainer, checkpoint: Path, out: Path) -> None:
    """scripts/export_hf.py writes a directory transformers loads, with the actor's logits."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = [sys.executable, str(ROOT / "scripts/export_hf.py")]
    # The run directory: its newest good, intact step (4, the one given below).
    done = subprocess.run([*script, str(checkpoint.parents[1]), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("(step 4)"), done.stderr[-2000:]
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 4,
        "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    done = subprocess.run([*script, str(checkpoint), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = "1 2 + 3 4 ="
    assert tok(text, add_special_tokens=False)["input_ids"] == trainer.tokenizer.encode(text)
    ids = np.array([[1, 5, 6, 13, 7, 8, 14]], np.int32)
    mask = np.ones_like(ids)
    ours = np.asarray(trainer.actor_model.forward(trainer.actor.params, ids, mask))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
