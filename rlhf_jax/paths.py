"""Every path the package names, once: the repository's folders and a run directory's layout.

Imports nothing but `pathlib`, so the config (read without jax) can use it.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO / "configs"
MESHES_DIR = REPO / "meshes"  # mesh presets, one `<name>.yaml` each
RULES_DIR = MESHES_DIR / "rules"  # the logical-axis rules presets refer to
DEFAULT_CONFIG = CONFIGS_DIR / "ppo_tiny_cpu.yaml"  # the embedded default run

# Inside `trainer.default_local_dir`:
RUN_CONFIG = "config.yaml"  # the resolved config of the run
CHECKPOINTS = "checkpoints"  # `checkpoints/<step>`
METRICS = "metrics.jsonl"  # every step's metrics (the jsonl tracker)
PROFILE = "profile"  # `trainer.profile_steps` traces
LORA_BASE = "lora_base"  # a LoRA run's warm-started base (HF directory), when it has one
