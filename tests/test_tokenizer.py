"""load_tokenizer against transformers.AutoTokenizer on tiny tokenizers built here."""

import json

import jinja2
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rlhf_jax.errors import ModelError
from rlhf_jax.tokenizer import load_tokenizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April.",
    "How many clips did Natalia sell altogether in April and May?",
    "Let's think step by step and output the final answer after ####.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# Plain `{% %}` tags on their own indented lines: the output depends on trim/lstrip_blocks.
PLAIN_TAGS = """{% for m in messages %}
  {% if m['role'] == 'user' %}
{{ bos_token }}U: {{ m['content'] }}
  {% else %}
A: {{ m['content'] }}{{ eos_token }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:{% endif %}"""
CONVERSATION = [
    {"role": "user", "content": "How many clips did Natalia sell?"},
    {"role": "assistant", "content": "She sold 72 clips. #### 72"},
]


def _train_bpe() -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    return tok


def _write_dir(path, config, generation_config=None):
    path.mkdir()
    _train_bpe().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML,
              "clean_up_tokenization_spaces": False}
    return _write_dir(tmp_path_factory.mktemp("tok") / "qwen", config,
                      generation_config={"eos_token_id": [2, 0]})


@pytest.fixture(scope="module")
def hf(qwen_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


def test_token_ids_match_hf(qwen_dir, hf):
    ours = load_tokenizer(qwen_dir)
    for text in [*SENTENCES, "unseen wörds 123 <|im_end|> tail", ""]:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(qwen_dir, hf, add_generation_prompt):
    ours = load_tokenizer(qwen_dir)
    text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt,
                                      tokenize=False)
    assert text == expected
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    turns = ("<|im_start|>user\nHow many clips did Natalia sell?<|im_end|>\n"
             "<|im_start|>assistant\nShe sold 72 clips. #### 72<|im_end|>\n")
    assert text == system + turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    ids = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt,
                                   tokenize=True)
    assert ids == hf.encode(expected, add_special_tokens=False)


def test_special_token_properties(qwen_dir, hf):
    ours = load_tokenizer(qwen_dir)
    assert ours.eos_token_ids == (2, 0)  # tokenizer eos first, then generation_config's
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.pad_token_id == hf.pad_token_id == 0
    assert ours.bos_token_id is None
    assert ours.vocab_size == len(hf)
    assert ours.batch_decode([ours.encode(SENTENCES[0]), [2]]) == [SENTENCES[0], ""]


def test_raise_exception_in_template(qwen_dir):
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        load_tokenizer(qwen_dir).apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_bos_post_processor_added_token_dict_and_jinja_file(tmp_path, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
              "bos_token": {"__type": "AddedToken", "content": "<|im_start|>"},
              "eos_token": "<|endoftext|>"}
    path = _write_dir(tmp_path / "llama", config)
    raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B",
        special_tokens=[("<|im_start|>", 1)])
    raw.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(PLAIN_TAGS)
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.add_bos_token
    assert ours.pad_token_id == ours.eos_token_id == 0  # no pad token: falls back to eos
    assert ours.eos_token_ids == (0,)
    text = SENTENCES[1]
    assert ours.encode(text, add_special_tokens=True) == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=True)[0] == 1
    chat = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert chat == ref.apply_chat_template(CONVERSATION, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert chat.startswith("<|im_start|>U: How many")


def test_missing_directory_and_file(tmp_path):
    with pytest.raises(ModelError, match="tokenizer directory not found: .*nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(ModelError, match=f"{tmp_path} has no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_no_chat_template_and_unknown_special_token(tmp_path):
    path = _write_dir(tmp_path / "plain", {"eos_token": "<|endoftext|>"})
    with pytest.raises(ModelError, match="has no chat_template"):
        load_tokenizer(path).apply_chat_template(CONVERSATION)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ModelError, match="eos_token '</s>' is not in the vocabulary"):
        load_tokenizer(path)
