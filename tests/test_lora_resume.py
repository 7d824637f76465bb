"""LoRA runs through the trainer (issue 27): a run killed with SIGKILL and resumed equals one
never killed; its checkpoints hold the adapters (no base weights) and name the base the SFT
warm start saved; `export_hf.py --format peft|merged` of the run agree under transformers."""

import json
import subprocess
import sys

import numpy as np
import pytest
from test_resume import _kill_after, _manifest, _resumed_steps, reference_run
from tiny_run import MACHINE, ROOT, steps_logged, tiny_overrides, train_script

RUN = {"mesh": "single", "trainer.total_training_steps": 4, "trainer.save_freq": 2,
       "trainer.test_freq": -1,
       "actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8,
       "actor_rollout_ref.actor.optim.lr": 5e-3,
       "critic.model.lora_rank": 4, "critic.model.target_modules": "[q_proj,v_proj]"}


@pytest.mark.slow  # three training processes and two exports: ~4 minutes on 2 cores
def test_lora_sigkill_resume_checkpoint_and_export(tmp_path):
    ref_dir, cut_dir = reference_run(tmp_path, RUN)
    _kill_after(train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir),
                _manifest(cut_dir / "run", 2))
    last = train_script(tiny_overrides(cut_dir, **RUN), cwd=cut_dir)
    assert last.wait(timeout=900) == 0, (cut_dir / "stdout.txt").read_text()[-3000:]
    assert _resumed_steps((cut_dir / "stdout.txt").read_text()) == [2]
    want, got = steps_logged(ref_dir / "run"), steps_logged(cut_dir / "run")
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for step in want:
        a = {k: v for k, v in want[step].items() if not k.startswith(MACHINE)}
        b = {k: v for k, v in got[step].items() if not k.startswith(MACHINE)}
        assert a == b, (step, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)})
    # each step's sync moves the adapters alone (the base moved once, after the warm start)
    base_bytes = (ref_dir / "run/lora_base/model.safetensors").stat().st_size
    moved = {want[s]["perf/sync_bytes"] for s in want}
    assert len(moved) == 1 and 0 < moved.pop() < 0.25 * base_bytes

    run = cut_dir / "run"
    ckpt = run / "checkpoints" / "4"
    meta = json.loads((ckpt / "meta" / "metadata").read_text())
    assert meta["lora_base"]["actor"]["path"] == str((run / "lora_base").resolve())
    assert meta["lora_base"]["critic"] == meta["lora_base"]["actor"]  # its backbone's
    tree = json.loads((ckpt / "state" / "_METADATA").read_text())["tree_metadata"]
    stored = [k for k, v in tree.items() if v["value_metadata"]["value_type"] != "None"]
    actor_params = [k for k in stored if k.startswith("('actor', 'params'")]
    critic_params = [k for k in stored if k.startswith("('critic', 'params'")]
    assert actor_params and all("_lora'" in k for k in actor_params), actor_params
    assert all("_lora'" in k or "'score'" in k for k in critic_params), critic_params
    assert not any(k.startswith("('ref'") for k in stored)  # the reference is the base

    for fmt in ("peft", "merged"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts/export_hf.py"), str(run),
                              str(tmp_path / fmt), "--format", fmt],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
    import peft
    import torch
    import transformers

    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    base = transformers.AutoModelForCausalLM.from_pretrained(run / "lora_base",
                                                             dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft")(input_ids=ids)
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "merged", dtype=torch.float32)(input_ids=ids)
    assert np.abs(adapted.logits.numpy() - plain).max() > 1e-4  # trained adapters
    np.testing.assert_allclose(adapted.logits.numpy(), merged.logits.numpy(), atol=1e-4)
