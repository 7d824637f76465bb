"""Export a trained actor as an HF model: `python scripts/export_hf.py CHECKPOINT OUT_DIR`.

CHECKPOINT is `<trainer.default_local_dir>/checkpoints/<step>`, or a run directory (its
newest good, intact step); OUT_DIR gets config.json, safetensors, the tokenizer files and a
generation_config.json (the run's eos / pad / bos ids and rollout sampling), loadable with
`transformers`' `from_pretrained`. A LoRA run's actor is written merged into its base
(`--format merged`, the default) or as a PEFT adapter directory (`--format peft`:
adapter_config.json + adapter_model.safetensors, for `peft.PeftModel.from_pretrained` on the
base the checkpoint names). A damaged newer step that is skipped is one `warning:`
line. Errors print one line (`error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from rlhf_jax.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint step folder (<run>/checkpoints/<step>) "
                        "or a run directory (its newest good, intact step)")
    parser.add_argument("out_dir", help="the HF directory to write")
    parser.add_argument("--format", choices=("merged", "peft"), default="merged",
                        help="a LoRA actor: merged into its base (an HF model), or its PEFT "
                        "adapters alone")
    args = parser.parse_args(argv)
    try:
        from rlhf_jax.checkpoint import CheckpointWarning
        from rlhf_jax.export import export_hf

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            out, step = export_hf(args.checkpoint, args.out_dir, args.format)
        for w in caught:
            if issubclass(w.category, CheckpointWarning):
                print(f"warning: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
