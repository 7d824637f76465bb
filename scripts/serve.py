"""Serve an HF model directory through JetStream's gRPC server:
`python scripts/serve.py --model PATH [--port 9000] [--mesh single]`.

Needs the `jetstream` extra (`pip install google-jetstream==0.2.2`). The server listens on
127.0.0.1 only unless `--host` says otherwise; clients send JetStream `DecodeRequest`s (token
ids, or text when the directory has a tokenizer.json). Sampling is greedy unless
`--temperature` > 0. Input errors print one line (`error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_jax.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--mesh", default="single", help="mesh preset in meshes/ (default: single)")
    p.add_argument("--max-concurrent-decodes", type=int, default=8)
    p.add_argument("--max-prefill-length", type=int, default=256,
                   help="longest prompt; JetStream needs 16 * 2^k")
    p.add_argument("--max-decode-length", type=int, default=256, help="longest response")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """The `JetStreamEngine` for `args` (model loaded on the generate layout)."""
    import jax

    from rlhf_jax.mesh import load_mesh_spec, make_mesh
    from rlhf_jax.models.hf_io import load_hf_model
    from rlhf_jax.rollout import Engine, SamplingParams
    from rlhf_jax.rollout.jetstream_adapter import JetStreamEngine

    spec = load_mesh_spec(args.mesh)
    mesh = make_mesh(spec)
    model, params = load_hf_model(args.model, mesh, spec.generate_rules)
    tokenizer = None
    if (Path(args.model) / "tokenizer.json").is_file():
        from rlhf_jax.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    eos = tokenizer.eos_token_ids if tokenizer is not None else model.cfg.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        do_sample=args.temperature > 0, eos_ids=eos, pad_id=0 if pad is None else pad,
    )
    engine = Engine(model, mesh, spec.generate_rules,
                    max_concurrent_decodes=args.max_concurrent_decodes,
                    max_prefill_length=args.max_prefill_length,
                    max_decode_length=args.max_decode_length, sampling=sampling)
    # JetStream prepends a BOS to every prompt; without one (Qwen) the adapter drops it again.
    if tokenizer is not None:
        bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    else:
        bos = model.cfg.bos_token_id
    return JetStreamEngine(engine, params, sampling=sampling, tokenizer=tokenizer, bos_id=bos,
                           rng=jax.random.key(args.seed))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from rlhf_jax.rollout.jetstream_adapter import serve
    except ModuleNotFoundError as exc:
        print(f"error: {exc.name} is missing; install the extra: "
              f"pip install google-jetstream==0.2.2", file=sys.stderr)
        return 2
    try:
        server = serve(build(args), port=args.port, host=args.host)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"serving {args.model} on {args.host}:{args.port} (JetStream gRPC)", flush=True)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
