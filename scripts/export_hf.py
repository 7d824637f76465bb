"""Export a trained actor as an HF model: `python scripts/export_hf.py CHECKPOINT OUT_DIR`.

CHECKPOINT is `<trainer.default_local_dir>/checkpoints/<step>`; OUT_DIR gets config.json,
safetensors and the tokenizer files, loadable with `transformers`' `from_pretrained`.
Errors print one line (`error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from rlhf_jax.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint step folder: <run>/checkpoints/<step>")
    parser.add_argument("out_dir", help="the HF directory to write")
    args = parser.parse_args(argv)
    try:
        from rlhf_jax.export import export_hf

        out = export_hf(args.checkpoint, args.out_dir)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
