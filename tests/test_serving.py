"""Serving: prompts formatted as in training, the same greedy answers as the trainer's
validation (on a policy the slow tests train), the OpenAI client against the HTTP endpoint
(plain and streamed, completions and chat; on a random model by default, on the trained
checkpoint in the slow set), OpenAI-style errors, generation_config.json, and a serving path
that imports without the JetStream extra."""

import http.client
import json
import subprocess
import sys

import numpy as np
import openai  # the test extra
import pytest
from tiny_run import ROOT, tiny

# Enough warm-start steps that the greedy answers differ from prompt to prompt.
TRAIN = {"mesh": "single", "trainer.total_training_steps": 2, "trainer.save_freq": 2,
         "trainer.test_freq": -1, "trainer.sft_warmup.max_steps": 150,
         "trainer.sft_warmup.eval_every": 150}


def _serve(served):
    import portpicker

    from rlhf_jax.serving.http_server import serve_http

    server = serve_http(served, port=portpicker.pick_unused_port())
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """(served model, base url, data dir) of the tiny task's architecture with random
    weights (large, so that greedy decoding has no near ties) and the task's tokenizer."""
    import jax

    from rlhf_jax.models import Model, ModelConfig
    from rlhf_jax.models.hf_io import save_hf
    from rlhf_jax.serving import load_served_model
    from rlhf_jax.tasks import addition

    tmp = tmp_path_factory.mktemp("random")
    model = Model(ModelConfig.from_hf(addition.MODEL))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.5 + (s.ndim == 1)).astype(
        s.dtype), model.abstract_params())
    addition.make_tokenizer(tmp / "hf")
    save_hf(model, params, tmp / "hf")
    addition.make_dataset(tmp / "val.parquet", 8, seed=3)
    served = load_served_model(tmp / "hf", max_concurrent_decodes=4, max_prefill_length=8,
                               max_decode_length=4,
                               compiler_options={"xla_backend_optimization_level": 0})
    server, url = _serve(served)
    yield served, url, tmp
    server.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(trainer, served model, base url): 150 warm-start and 2 PPO steps of the tiny task, the
    run directory exported and served on a free loopback port."""
    from rlhf_jax.export import export_hf
    from rlhf_jax.serving import load_served_model
    from rlhf_jax.trainer import Trainer

    tmp = tmp_path_factory.mktemp("serve")
    trainer = Trainer(tiny(tmp, **TRAIN))
    trainer.run()
    out, step = export_hf(tmp / "run", tmp / "hf")
    assert step == 2
    d = trainer.cfg.data
    served = load_served_model(out, max_concurrent_decodes=4,
                               max_prefill_length=d.max_prompt_length,
                               max_decode_length=d.max_response_length)
    server, url = _serve(served)
    yield trainer, served, url
    server.close()


def _client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_prompts_are_formatted_as_in_training(random_model):
    from rlhf_jax.data import PromptDataset
    from rlhf_jax.serving import parity

    served, _, tmp = random_model
    dataset = PromptDataset(str(tmp / "val.parquet"), served.tokenizer, max_prompt_length=8)
    messages = parity._messages([str(tmp / "val.parquet")], "prompt")
    for i in range(len(dataset)):
        want = dataset[i]["input_ids"].tolist()
        assert want[0] == served.tokenizer.bos_token_id  # the template's BOS
        assert served.encode(messages[i]) == want
        assert served.encode(messages[i][0]["content"]) == want  # a text: one user message
    served.raw_prompts = True  # --raw-prompts: no template, so no BOS
    try:
        text = messages[0][0]["content"]
        assert served.encode(text) == dataset[0]["input_ids"].tolist()[1:]
    finally:
        served.raw_prompts = False


@pytest.mark.slow  # trains the policy it serves (~1 minute on 2 cores)
def test_server_answers_as_the_trainers_validation(run):
    from rlhf_jax.serving import parity

    trainer, served, url = run
    rows = parity.validation_generations(trainer)
    answers = parity.ask_server(url, served.name, rows,
                                max_tokens=trainer.cfg.data.max_response_length)
    result = parity.compare(trainer, rows, answers)
    assert result["prompts"] == len(trainer.val_loader.dataset) == 16
    assert result["identical_prompt_ids"] == result["identical_answers"] == 16, result
    assert result["server_correct"] == result["trainer_correct"]
    assert len({tuple(r["response_ids"]) for r in rows}) > 4  # not one answer for all


def _engine_greedy(served, prompts, max_tokens):
    from rlhf_jax.rollout import generate_sequences

    p = served.engine.max_prefill_length
    ids = np.zeros((len(prompts), p), np.int32)
    mask = np.zeros_like(ids)
    for i, x in enumerate(prompts):
        ids[i, p - len(x):], mask[i, p - len(x):] = x, 1
    sampling = served.sampling(temperature=0)
    # The server's programs: 8 steps a call, one prefill of the (padded) 4 prompts.
    out = generate_sequences(served.engine, served.params, ids, mask, sampling=sampling,
                             max_lengths=[max_tokens] * len(prompts), steps_per_call=8)
    return [row[:k].tolist() for row, k in zip(out.responses, out.response_lengths,
                                                strict=True)]


def test_openai_client_on_a_random_model(random_model):
    served, url, _ = random_model
    _check_openai_client(served, url)


@pytest.mark.slow  # trains the policy it serves (shares the fixture above)
def test_openai_client_on_the_trained_checkpoint(run):
    _, served, url = run
    _check_openai_client(served, url)


def _check_openai_client(served, url):
    client = _client(url)
    assert [m.id for m in client.models.list().data] == [served.name] == ["hf"]
    texts = ["1 2 + 3 4 =", "9 9 + 9 9 =", "5 0 + 1 7 ="]
    prompts = [served.encode(t) for t in texts]
    want = _engine_greedy(served, prompts, 4)
    want_text = [served.tokenizer.decode(w) for w in want]
    assert len(set(map(tuple, want))) > 1  # the prompts get different answers
    extra = {"return_token_ids": True}

    got = client.completions.create(model="hf", prompt=texts, temperature=0, max_tokens=4,
                                    extra_body=extra)
    assert [c.token_ids for c in got.choices] == want
    assert [c.prompt_token_ids for c in got.choices] == prompts
    assert [c.text for c in got.choices] == want_text
    assert got.usage.completion_tokens == sum(map(len, want))
    assert got.usage.prompt_tokens == sum(map(len, prompts))
    for c, w in zip(got.choices, want, strict=True):
        assert c.finish_reason == ("stop" if w[-1] in served.eos_ids else "length")
    ids_prompt = client.completions.create(model="hf", prompt=prompts[1], temperature=0,
                                           max_tokens=4, extra_body=extra)
    assert ids_prompt.choices[0].token_ids == want[1]

    chat = client.chat.completions.create(
        model="hf", messages=[{"role": "user", "content": texts[0]}], temperature=0,
        max_tokens=4, n=2, extra_body=extra)
    assert [c.message.content for c in chat.choices] == [want_text[0]] * 2
    assert [c.token_ids for c in chat.choices] == [want[0]] * 2

    stream = client.chat.completions.create(
        model="hf", messages=[{"role": "user", "content": texts[2]}], temperature=0,
        max_tokens=4, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == want_text[2]
    assert sum((c.choices[0].token_ids for c in chunks if c.choices), []) == want[2]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want[2])

    text = {}
    for c in client.completions.create(model="hf", prompt=texts[:2], temperature=0,
                                       max_tokens=4, stream=True):
        text[c.choices[0].index] = text.get(c.choices[0].index, "") + c.choices[0].text
    assert [text[0], text[1]] == want_text[:2]

    # Sampling with a seed: the same seed gives the same answer.
    a, b = (client.completions.create(model="hf", prompt=texts[0], temperature=1.0, seed=7,
                                      max_tokens=4, extra_body=extra).choices[0].token_ids
            for _ in range(2))
    assert a == b

    # Greedy and sampled requests at once: the slots serve one sampler at a time, and each
    # request still gets its own answer.
    from concurrent.futures import ThreadPoolExecutor

    def ask(i):
        temperature = 1.0 if i % 2 else 0
        r = client.completions.create(model="hf", prompt=texts[i % 3], temperature=temperature,
                                      seed=7, max_tokens=4, extra_body=extra)
        return r.choices[0].token_ids

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    assert [got[i] for i in (0, 2, 4)] == [want[0], want[2], want[1]]
    assert got[3] == a  # texts[0], seed 7, sampled


def _raw(url, method, path, body=None):
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_bad_requests_get_openai_errors(random_model):
    served, url, _ = random_model
    ok = {"model": "hf", "prompt": "1 2 + 3 4 =", "max_tokens": 2}
    cases = [
        (b"{not json", 400, "not valid JSON"),
        ({**ok, "max_tokens": 99}, 400, "'max_tokens' must lie in [1, 4]"),
        ({**ok, "temperature": 3}, 400, "'temperature' must lie in [0, 2]"),
        ({**ok, "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({**ok, "stop": ["\n"]}, 400, "stop sequences are not implemented"),
        ({**ok, "logprobs": 0}, 400, "log-probabilities"),
        ({**ok, "echo": True}, 400, "echo is not implemented"),
        ({**ok, "frobnicate": 1}, 400, "Unrecognized request argument supplied: frobnicate"),
        ({**ok, "prompt": "1 2 + 3 4 = ?"}, 400, "cannot tokenize"),
        ({**ok, "prompt": [99]}, 400, "outside the vocabulary"),
        ({**ok, "prompt": []}, 400, "'prompt' must be"),
        ({**ok, "prompt": "1 2 3 4 5 6 7 8 9"}, 400, "more than the server's max_prefill"),
        ({**ok, "model": "gpt-4"}, 404, "does not exist"),
        ({k: v for k, v in ok.items() if k != "model"}, 400, "'model' is required"),
    ]
    for body, status, message in cases:
        got_status, got = _raw(url, "POST", "/v1/completions", body)
        assert got_status == status and message in got["error"]["message"], (body, got)
        assert got["error"]["type"] == "invalid_request_error"
    status, got = _raw(url, "POST", "/v1/chat/completions",
                       {"model": "hf", "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert status == 400 and "only text parts" in got["error"]["message"]
    status, got = _raw(url, "GET", "/v1/nothing")
    assert status == 404 and "no route" in got["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="must lie in"):
        _client(url).chat.completions.create(model="hf", messages=[
            {"role": "user", "content": "1 2 + 3 4 ="}], top_p=0)
    status, got = _raw(url, "POST", "/v1/completions", {**ok, "temperature": 0})
    assert status == 200 and got["choices"][0]["text"]  # still serving


def test_generation_config_is_the_rollouts(tmp_path):
    import dataclasses

    from transformers import GenerationConfig

    from rlhf_jax.export import generation_config
    from rlhf_jax.serving import GenerationDefaults
    from rlhf_jax.tasks import addition
    from rlhf_jax.tokenizer import load_tokenizer

    addition.make_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    cfg = tiny(tmp_path)
    ro = cfg.actor_rollout_ref.rollout
    with_rollout = lambda **kw: dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(
        cfg.actor_rollout_ref, rollout=dataclasses.replace(ro, **kw)))
    cases = [(cfg, (True, 1.0, 1.0, 0)),  # the recipe's rollout; top_k -1 (off) is HF's 0
             (with_rollout(temperature=0.7, top_k=5, top_p=0.9), (True, 0.7, 0.9, 5)),
             # greedy: do_sample alone (transformers fills in 1.0 / 1.0 / 50 for None)
             (with_rollout(do_sample=False), (False, None, None, None))]
    for c, want in cases:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config(c, tok)))
        g = GenerationConfig.from_pretrained(tmp_path)
        assert (g.do_sample, g.temperature, g.top_p, g.top_k) == want
        assert (g.eos_token_id, g.pad_token_id, g.bos_token_id) == (2, 0, 1) == (
            tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
        assert g.max_new_tokens == cfg.data.max_response_length == 4
        d = GenerationDefaults.read(tmp_path)  # what the server takes from it
        assert (d.do_sample, d.temperature, d.top_p, d.top_k) == tuple(
            x if x is not None else dflt for x, dflt in zip(want, (0, 1.0, 1.0, 50),
                                                            strict=True))
        assert d.max_new_tokens == 4


def test_export_refuses_a_folder_without_checkpoints(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts/export_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "is neither a checkpoint step folder" in err and "nor a run directory" in err


_NO_JETSTREAM = """
import sys
sys.modules["jetstream"] = None          # as if the extra were not installed
sys.modules["tensorflow"] = None
import rlhf_jax.serving.http_server, rlhf_jax.serving.openai_api  # noqa: E401
sys.argv = ["serve.py", "--model", sys.argv[1], "--api", "jetstream"]
assert "tensorflow" not in [m for m, v in sys.modules.items() if v is not None]
import runpy
try:
    runpy.run_path(%r, run_name="__main__")
except SystemExit as e:
    print("rc", e.code)
"""


def test_serving_imports_without_the_jetstream_extra(tmp_path):
    code = _NO_JETSTREAM % str(ROOT / "scripts/serve.py")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().endswith("rc 2"), out.stdout + out.stderr
    assert out.stderr.strip() == ("error: jetstream is missing; install the extra: pip install "
                                  "google-jetstream==0.2.2 (or serve with --api openai)")
