"""Check that the server answers a run's validation prompts as the trainer's validation does:
`python scripts/serve_check.py RUN_DIR [--mesh single]`.

Resumes the trainer of RUN_DIR (`<run>/config.yaml`) at its newest good checkpoint and
generates its validation answers (`val_kwargs` sampling); exports that checkpoint with
`export_hf`, serves the export on a free loopback port through the OpenAI endpoint and sends
it the validation prompts' chat messages (greedy). Prints one JSON object: prompts, identical
prompt ids, identical answers (token for token), and how many each side gets right by the
run's reward. Errors print one line (`error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rlhf_jax.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a run directory of scripts/train.py (with checkpoints/)")
    p.add_argument("--mesh", default="single", help="the server's mesh preset")
    p.add_argument("--max-concurrent-decodes", type=int, default=8)
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    try:
        from rlhf_jax import paths
        from rlhf_jax.config import load_config

        if not (run / paths.RUN_CONFIG).is_file() or not (run / paths.CHECKPOINTS).is_dir():
            raise UserError(f"{run} is not a run directory (no {paths.RUN_CONFIG} and "
                            f"{paths.CHECKPOINTS}/)")
        cfg = load_config(run / paths.RUN_CONFIG, ["trainer.logger=[console]",
                                                   "trainer.resume_mode=auto"])
        if not cfg.data.val_files:
            raise UserError(f"{run}: the run has no data.val_files")
        import portpicker

        from rlhf_jax.export import export_hf
        from rlhf_jax.serving import load_served_model, parity
        from rlhf_jax.serving.http_server import serve_http
        from rlhf_jax.trainer import Trainer

        with tempfile.TemporaryDirectory(prefix="serve_check_") as tmp:
            trainer = Trainer(cfg)  # first: its mesh asks for the simulated CPU devices
            trainer.start()
            out, step = export_hf(run, Path(tmp) / "hf")
            if trainer.global_step != step:
                raise UserError(f"the trainer resumed at step {trainer.global_step}, the "
                                f"export is step {step}")
            rows = parity.validation_generations(trainer)
            served = load_served_model(
                out, mesh=args.mesh, max_concurrent_decodes=args.max_concurrent_decodes,
                max_prefill_length=cfg.data.max_prompt_length,
                max_decode_length=cfg.data.max_response_length)
            server = serve_http(served, port=portpicker.pick_unused_port())
            try:
                url = f"http://127.0.0.1:{server.server_address[1]}/v1"
                answers = parity.ask_server(url, served.name, rows,
                                            max_tokens=cfg.data.max_response_length)
            finally:
                server.close()
            result = {"run": str(run), "step": step, "server_mesh": args.mesh,
                      **parity.compare(trainer, rows, answers)}
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
