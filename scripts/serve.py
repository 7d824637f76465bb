"""Serve an HF model directory with the rollout engine:
`python scripts/serve.py --model PATH [--port 8000] [--api openai|jetstream|both]`.

`openai` (the default) answers OpenAI's `/v1/completions`, `/v1/chat/completions` (also
streamed) and `/v1/models` over HTTP on `--port`; `jetstream` runs JetStream's gRPC server on
`--grpc-port` (needs the `jetstream` extra: `pip install google-jetstream==0.2.2`); `both`
runs the two on one engine. Everything listens on 127.0.0.1 unless `--host` says otherwise.
Prompts are formatted as the trainer formatted them (the chat template and its BOS; a text
prompt is one user message) unless `--raw-prompts`; token-id prompts are taken as they are.
Sampling defaults come from the directory's generation_config.json (what export_hf.py
writes; greedy without one); `--temperature`, `--top-p`, `--top-k` replace them (for the
gRPC server, which has no per-request sampling, and as the HTTP requests' defaults). Input
errors print one line (`error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import threading

from rlhf_jax.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--api", choices=("openai", "jetstream", "both"), default="openai")
    p.add_argument("--port", type=int, default=8000, help="the OpenAI HTTP port")
    p.add_argument("--grpc-port", type=int, default=9000, help="the JetStream gRPC port")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of the HTTP API (default: the directory's name)")
    p.add_argument("--mesh", default="single", help="mesh preset in meshes/ (default: single)")
    p.add_argument("--max-concurrent-decodes", type=int, default=8)
    p.add_argument("--max-prefill-length", type=int, default=256,
                   help="longest prompt; JetStream needs 16 * 2^k")
    p.add_argument("--max-decode-length", type=int, default=256, help="longest response")
    p.add_argument("--temperature", type=float, default=None, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="-1 or 0: off")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--raw-prompts", action="store_true",
                   help="tokenize text prompts as they are, without the chat template")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The `GenerationDefaults` fields the flags set."""
    out = {}
    if args.temperature is not None:
        out.update(temperature=args.temperature, do_sample=args.temperature > 0)
    if args.top_p is not None:
        out["top_p"] = args.top_p
    if args.top_k is not None:
        out["top_k"] = args.top_k
    return out


def load(args: argparse.Namespace):
    """The `ServedModel` of `args` (model loaded on the generate layout)."""
    from rlhf_jax.serving import load_served_model

    return load_served_model(
        args.model, mesh=args.mesh, name=args.served_model_name,
        max_concurrent_decodes=args.max_concurrent_decodes,
        max_prefill_length=args.max_prefill_length, max_decode_length=args.max_decode_length,
        raw_prompts=args.raw_prompts, sampling_overrides=sampling_overrides(args))


def build_jetstream(served, seed: int):
    """The `JetStreamEngine` over `served`'s engine, with its default sampling for every
    request. The orchestrator's BOS is dropped again (bos_id None): text gets the chat
    template's, token ids are taken as they are."""
    import jax

    from rlhf_jax.rollout.jetstream_adapter import JetStreamEngine

    encode = served.encode if served.tokenizer is not None else None
    return JetStreamEngine(served.engine, served.params, sampling=served.sampling(),
                           tokenizer=served.tokenizer, bos_id=None, rng=jax.random.key(seed),
                           encode=encode)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jetstream = args.api in ("jetstream", "both")
    if jetstream:
        try:
            from rlhf_jax.rollout.jetstream_adapter import serve
        except ModuleNotFoundError as exc:
            missing = (exc.name or "jetstream").split(".")[0]
            print(f"error: {missing} is missing; install the extra: "
                  f"pip install google-jetstream==0.2.2 (or serve with --api openai)",
                  file=sys.stderr)
            return 2
    try:
        served = load(args)
        waits = []
        if jetstream:
            grpc = serve(build_jetstream(served, args.seed), port=args.grpc_port,
                         host=args.host)
            print(f"serving {args.model} on {args.host}:{args.grpc_port} (JetStream gRPC)",
                  flush=True)
            waits.append(grpc.wait_for_termination)
        if args.api in ("openai", "both"):
            import jax

            from rlhf_jax.serving.http_server import OpenAIServer

            http = OpenAIServer(served, host=args.host, port=args.port,
                                rng=jax.random.key(args.seed))
            print(f"serving {args.model} as {served.name!r} on http://{args.host}:{args.port}/v1 "
                  "(OpenAI API)", flush=True)
            waits.append(http.serve_forever)
    except OSError as exc:  # the port is taken, or the host is not ours
        print(f"error: cannot listen: {exc}", file=sys.stderr)
        return 2
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = [threading.Thread(target=w, daemon=True) for w in waits]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
