"""Chat templates of the Qwen3 and Llama 3.x families render as transformers'
`apply_chat_template` for the same messages and template variables (`enable_thinking`,
`tools`, `date_string`), on tokenizer directories built here.

The templates are written for these tests after the families' published ones, with the same
constructs: Qwen3's reverse scan for the last user query with a namespace, the split of
`<think>` reasoning out of earlier assistant turns, the empty think block of
`enable_thinking=false`, tool calls and grouped tool responses; Llama 3.1's BOS, the system
header with its date, tools in the first user message (`tojson(indent=4)`), `ipython` turns.
"""

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlhf_jax.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

QWEN3_TEMPLATE = r"""{%- set system_turn = messages and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system_turn %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif system_turn %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{#- The last real user query: later assistant turns keep their reasoning. #}
{%- set scan = namespace(open=true, last_query=messages | length - 1) %}
{%- for m in messages[::-1] %}
    {%- set at = messages | length - 1 - loop.index0 %}
    {%- if scan.open and m.role == 'user' and m.content is string
          and not (m.content.startswith('<tool_response>')
                   and m.content.endswith('</tool_response>')) %}
        {%- set scan.open = false %}
        {%- set scan.last_query = at %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]
                                       .lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > scan.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n'
                + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for call in m.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set call = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if tools_in_user_message is not defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if date_string is not defined %}
    {%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{%- if tools is not defined %}
    {%- set tools = none %}
{%- endif %}
{#- The system turn is always written; a given system message goes inside it. #}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}
{%- if tools is not none and not tools_in_user_message %}
    {{- 'You have access to the following functions. To call a function, please respond with '
        'JSON for a function call.\nRespond in the format {"name": function name, '
        '"parameters": dictionary of argument name and its value}.\nDo not use variables.\n\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) + '\n\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length == 0 %}
        {{- raise_exception('tools go into the first user message, and there is none') }}
    {%- endif %}
    {%- set first_user_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with '
        'its proper arguments that best answers the given prompt.\n\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument '
        'name and its value}.Do not use variables.\n\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) + '\n\n' }}
    {%- endfor %}
    {{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role in ('ipython', 'tool') %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {{- m.content | tojson if m.content is mapping else m.content }}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in m %}
        {%- if m.tool_calls | length != 1 %}
            {{- raise_exception('one tool call per assistant turn') }}
        {%- endif %}
        {%- set call = m.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' }}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim }}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

SENTENCES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "The weather in Paris is sunny. {\"name\": \"get_weather\", \"arguments\": {}}",
]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather",
                                         "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one_question": [{"role": "user", "content": "How many clips did Natalia sell?"}],
    "system_and_turns": [
        {"role": "system", "content": "You are a careful math tutor.  "},
        {"role": "user", "content": "How many clips in April?"},
        {"role": "assistant", "content": "<think>\nShe sold 48.\n</think>\n\n48 clips."},
        {"role": "user", "content": "And altogether?"},
        {"role": "assistant", "content": "<think>48 + 24</think>72 clips.",
         "tool_calls": None},
    ],
    "reasoning_field": [
        {"role": "user", "content": "How many clips?"},
        {"role": "assistant", "content": "72", "reasoning": "48 + 24 = 72"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny, 21 C"},
    ],
}


def _write_tokenizer_dir(path, specials, config, generation_config):
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
         **config}))
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (ours, transformers'), from one directory each."""
    tmp = tmp_path_factory.mktemp("chat")
    qwen3 = _write_tokenizer_dir(
        tmp / "qwen3", QWEN3_SPECIALS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "chat_template": QWEN3_TEMPLATE},
        {"eos_token_id": [2, 0]})
    llama3 = _write_tokenizer_dir(
        tmp / "llama3", LLAMA3_SPECIALS,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        {"eos_token_id": [1, 5, 4]})
    (llama3 / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)  # the 5.x place for it
    return {name: (load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path)))
            for name, path in (("qwen3", qwen3), ("llama3", llama3))}


def _both(pair, messages, **kw):
    ours, hf = pair
    text = ours.apply_chat_template(messages, **kw)
    want = hf.apply_chat_template(messages, tokenize=False, **kw)
    assert text == want
    ids = ours.apply_chat_template(messages, tokenize=True, **kw)
    assert ids == hf.encode(want, add_special_tokens=False)
    return text


@pytest.mark.parametrize("enable_thinking", [True, False, None])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_qwen3_template_matches_transformers(tokenizers, conversation, add_generation_prompt,
                                             enable_thinking):
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = _both(tokenizers["qwen3"], CONVERSATIONS[conversation],
                 add_generation_prompt=add_generation_prompt, **kw)
    empty_think = text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert empty_think == (add_generation_prompt and enable_thinking is False)


def test_qwen3_reasoning_stays_only_after_the_last_query(tokenizers):
    text = _both(tokenizers["qwen3"], CONVERSATIONS["system_and_turns"],
                 add_generation_prompt=False)
    assert "She sold 48" not in text  # an earlier turn's reasoning is dropped
    assert text.endswith("<|im_start|>assistant\n<think>\n48 + 24\n</think>\n\n72 clips."
                         "<|im_end|>\n")


def test_qwen3_tools(tokenizers):
    text = _both(tokenizers["qwen3"], CONVERSATIONS["tool_round_trip"], tools=[WEATHER_TOOL],
                 add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", ["one_question", "system_and_turns"])
def test_llama3_template_matches_transformers(tokenizers, conversation, add_generation_prompt):
    text = _both(tokenizers["llama3"], CONVERSATIONS[conversation], date_string="26 Jul 2024",
                 add_generation_prompt=add_generation_prompt)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")


def test_llama3_date_defaults_to_today_and_tools(tokenizers):
    _both(tokenizers["llama3"], CONVERSATIONS["one_question"], add_generation_prompt=True)
    text = _both(tokenizers["llama3"], CONVERSATIONS["tool_round_trip"], tools=[WEATHER_TOOL],
                 date_string="26 Jul 2024", add_generation_prompt=True)
    assert "Environment: ipython\n" in text and '"name": "get_weather"' in text
    assert text.endswith("<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21 C<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    text = _both(tokenizers["llama3"], CONVERSATIONS["tool_round_trip"], tools=[WEATHER_TOOL],
                 tools_in_user_message=False, date_string="26 Jul 2024",
                 add_generation_prompt=False)
    assert "You have access to the following functions" in text


def test_special_tokens_of_the_families(tokenizers):
    qwen3, hf_qwen3 = tokenizers["qwen3"]
    assert qwen3.eos_token_ids == (2, 0) and qwen3.pad_token_id == hf_qwen3.pad_token_id == 0
    llama3, hf_llama3 = tokenizers["llama3"]
    assert llama3.bos_token_id == hf_llama3.bos_token_id == 0
    assert llama3.eos_token_ids == (4, 1, 5)  # <|eot_id|> first, then generation_config's
