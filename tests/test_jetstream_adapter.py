"""The engine behind JetStream 0.2.2's own orchestrator and gRPC server gives the same greedy
tokens as the rollout driver. Needs the `jetstream` extra: pip install google-jetstream==0.2.2."""

import asyncio
import logging

import jax
import numpy as np
import pytest

jetstream = pytest.importorskip("jetstream")

from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

from rlhf_jax.mesh import load_mesh_spec, make_mesh  # noqa: E402
from rlhf_jax.models import Model, ModelConfig  # noqa: E402
from rlhf_jax.rollout import Engine, SamplingParams, generate_sequences  # noqa: E402
from rlhf_jax.rollout.jetstream_adapter import JetStreamEngine, serve  # noqa: E402

logging.getLogger().setLevel(logging.WARNING)  # jetstream's orchestrator sets DEBUG on import

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
R = 8
SAMPLING = SamplingParams(do_sample=False, max_response_length=R, eos_ids=(3, 5, 9), pad_id=0)
PROMPTS = [[12, 7, 30], [1, 2, 33, 4, 21, 8, 17], [25], [14, 14, 2, 6], [39, 11, 20, 31, 10]]


@pytest.fixture(scope="module")
def adapter():
    spec = load_mesh_spec("cpu-8")
    mesh = make_mesh(spec)
    model = Model(CFG)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.1 + (s.ndim == 1)).astype(
        s.dtype), model.abstract_params())
    engine = Engine(model, mesh, spec.generate_rules, max_concurrent_decodes=4,
                    max_prefill_length=16, max_decode_length=R, sampling=SAMPLING,
                    compiler_options={"xla_backend_optimization_level": 0})
    return JetStreamEngine(engine, engine.load_params(host), bos_id=None)


def _driver_tokens(adapter):
    ids = np.zeros((len(PROMPTS), 16), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, 16 - len(p):], mask[i, 16 - len(p):] = p, 1
    # One step per call and one prompt per prefill: the adapter's compiled functions serve.
    out = generate_sequences(adapter.engine, adapter.params, ids, mask, sampling=SAMPLING,
                             steps_per_call=1, max_prefill_batch=1)
    want = []
    for row, k in zip(out.responses, out.response_lengths, strict=True):
        row = list(row[:k])
        want.append(row[:-1] if row[-1] in SAMPLING.eos_ids else row)  # JetStream drops EOS
    assert len({len(w) for w in want}) > 1  # some stop early at an EOS
    return want


def _request(prompt):
    return jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
        max_tokens=R,
    )


async def _decode(stream):
    tokens = []
    async for response in stream:
        tokens.extend(response.stream_content.samples[0].token_ids)
    return tokens


def test_orchestrator_driver_gives_the_rollout_driver_tokens(adapter):
    want = _driver_tokens(adapter)
    params = adapter.load_params()
    driver = orchestrator.Driver(prefill_engines=[adapter], generate_engines=[adapter],
                                 prefill_params=[params], generate_params=[params],
                                 interleaved_mode=True)
    try:
        llm = orchestrator.LLMOrchestrator(driver=driver)

        async def run_all():  # more requests than slots: JetStream refills them
            return await asyncio.gather(*(_decode(llm.Decode(_request(p))) for p in PROMPTS))

        got = asyncio.run(asyncio.wait_for(run_all(), timeout=120))
    finally:
        driver.stop()
    assert got == want


def test_grpc_server_on_localhost(adapter):
    import grpc
    import portpicker

    want = _driver_tokens(adapter)[:2]
    port = portpicker.pick_unused_port()
    server = serve(adapter, port=port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = jetstream_pb2_grpc.OrchestratorStub(channel)
            got = []
            for p in PROMPTS[:2]:
                tokens = []
                for response in stub.Decode(_request(p), timeout=120):
                    tokens.extend(response.stream_content.samples[0].token_ids)
                got.append(tokens)
    finally:
        server.stop()
    assert got == want


def test_serve_script_reports_a_bad_model_dir_in_one_line(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
    spec = importlib.util.spec_from_file_location("serve_script", path)
    serve_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_script)
    assert serve_script.main(["--model", str(tmp_path), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model path") and "config.json" in err and "\n" not in err


def test_text_requests_are_formatted_as_in_training(adapter, tmp_path):
    """A text request gets the trainer's chat template (and its BOS) after the placeholder
    that the orchestrator prepends and prefill drops again (bos_id None)."""
    from rlhf_jax.prompts import encode_prompts
    from rlhf_jax.tasks import addition
    from rlhf_jax.tokenizer import load_tokenizer

    addition.make_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    js = JetStreamEngine(adapter.engine, adapter.params, tokenizer=tok, bos_id=None)
    padded, true_length = js.build_tokenizer(None).encode("1 2 + 3 4 =", is_bos=True,
                                                          max_prefill_length=16)
    want = encode_prompts(tok, ["1 2 + 3 4 ="])[1][0]
    assert want == [1, 4, 5, 13, 6, 7, 14]  # <bos> 1 2 + 3 4 =: what the data loader makes
    assert true_length == len(want) + 1
    assert [int(t) for t in padded[1:true_length]] == want
