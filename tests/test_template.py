"""everycycle.chatfmt.template: HF-style rendering of real chat templates, golden where it matters."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest
from templatehelp import GEMMA3, SMOLLM2, fixture_source, gguf_chat

from everycycle.chatfmt.template import CHATML, ChatTemplate, template_variables
from everycycle.errors import InvalidRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"},
                           "days": {"type": "integer", "description": "How many days"}},
            "required": ["city"],
        },
    },
}
CALL_ID = "abcDEF123"


def tool_turn(arguments: Any = '{"city": "Paris"}') -> list[dict[str, Any]]:
    """A user question, the assistant's call (arguments as the OpenAI JSON string), and
    the tool's answer."""
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "18C"},
    ]


def compile_fixture(name: str, bos: str = "<s>", eos: str = "</s>") -> ChatTemplate:
    return ChatTemplate.compile(fixture_source(name), bos_token=bos, eos_token=eos)


def inline(source: str) -> ChatTemplate:
    return ChatTemplate.compile(source, bos_token="<s>", eos_token="</s>")


# -- the templates inside the local GGUFs ------------------------------------------------


def test_smollm2_inserts_its_default_system_prompt() -> None:
    source, bos, eos = gguf_chat(SMOLLM2)
    assert source is not None
    t = ChatTemplate.compile(source, bos_token=bos, eos_token=eos)
    assert t.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_keeps_a_given_system_prompt() -> None:
    source, bos, eos = gguf_chat(SMOLLM2)
    assert source is not None
    t = ChatTemplate.compile(source, bos_token=bos, eos_token=eos)
    out = t.render([{"role": "system", "content": "Be terse."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"}], add_generation_prompt=False)
    assert out == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    assert "SmolLM" not in out


def test_gemma3_base_gguf_has_no_template_so_chatml_is_the_fallback() -> None:
    source, bos, eos = gguf_chat(GEMMA3)
    assert source is None  # (the 270M base model: no tokenizer.chat_template)
    assert (bos, eos) == ("<bos>", "<eos>")
    t = ChatTemplate.compile(source or CHATML, bos_token=bos, eos_token=eos)
    assert t.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_without_generation_prompt() -> None:
    t = inline(CHATML)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n")


# -- gemma 3 (instruct) ------------------------------------------------------------------


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn() -> None:
    t = compile_fixture("gemma-3-it", bos="<bos>", eos="<eos>")
    out = t.render([{"role": "system", "content": "Be kind."},
                    {"role": "user", "content": "  Hi  "},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": [{"type": "text", "text": "Look"},
                                                 {"type": "image"}]}])
    assert out == ("<bos><start_of_turn>user\nBe kind.\n\nHi<end_of_turn>\n"
                   "<start_of_turn>model\nHello!<end_of_turn>\n"
                   "<start_of_turn>user\nLook<start_of_image><end_of_turn>\n"
                   "<start_of_turn>model\n")


def test_gemma3_raise_exception_message_is_surfaced() -> None:
    t = compile_fixture("gemma-3-it", bos="<bos>", eos="<eos>")
    with pytest.raises(InvalidRequestError) as caught:
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert caught.value.message == (
        "Conversation roles must alternate user/assistant/user/assistant/...")


# -- Hermes / Qwen2.5 --------------------------------------------------------------------


def test_qwen25_default_system_and_no_tools() -> None:
    out = compile_fixture("qwen2.5-instruct").render([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                   "helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")


def test_qwen25_tools_calls_and_responses() -> None:
    out = compile_fixture("qwen2.5-instruct").render(tool_turn(), tools=[WEATHER])
    # tools, each as tojson (non-ASCII kept, nothing HTML-escaped)
    assert "\n<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in out
    assert "Météo d'une ville" in out
    # the call's JSON-string arguments reach the template as a dict (| tojson)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in out
    assert out.endswith("<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_arguments_that_are_not_json_stay_a_string() -> None:
    out = compile_fixture("qwen2.5-instruct").render(tool_turn("not json"), tools=[WEATHER])
    assert '"arguments": "not json"}' in out


def test_caller_messages_are_not_changed() -> None:
    msgs = tool_turn()
    before = json.dumps(msgs)
    compile_fixture("qwen2.5-instruct").render(msgs, tools=[WEATHER])
    assert json.dumps(msgs) == before


def test_hermes2pro_macro_and_python_signature() -> None:
    out = compile_fixture("hermes-2-pro-tool_use", bos="<|begin_of_text|>").render(
        tool_turn(), tools=[WEATHER])
    assert out.startswith("<|begin_of_text|><|im_start|>system\nYou are a function calling AI")
    assert "get_weather(city: str, days: int) - Météo d'une ville" in out
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in out
    assert out.endswith("<|im_start|>assistant\n")


# -- Llama 3.1 ---------------------------------------------------------------------------


def test_llama31_tools_in_first_user_message_with_indent() -> None:
    t = compile_fixture("llama-3.1-instruct", bos="<|begin_of_text|>", eos="<|eot_id|>")
    out = t.render(tool_turn(), tools=[WEATHER], date_string="01 Jan 2025")
    assert out.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                          "Environment: ipython\nCutting Knowledge Date: December 2023\n"
                          "Today Date: 01 Jan 2025\n\n<|eot_id|>")
    assert '\n    "type": "function",\n    "function": {\n        "name": "get_weather"' in out
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|eot_id|>') in out
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in out
    assert out.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama31_without_tools_defaults_its_date() -> None:
    t = compile_fixture("llama-3.1-instruct", bos="<|begin_of_text|>", eos="<|eot_id|>")
    out = t.render([{"role": "user", "content": "Hi"}])
    assert "Today Date: 26 Jul 2024\n\n<|eot_id|>" in out
    assert "ipython" not in out


def test_llama31_refuses_two_calls_in_one_message() -> None:
    msgs = tool_turn()
    msgs[1]["tool_calls"] = msgs[1]["tool_calls"] * 2
    t = compile_fixture("llama-3.1-instruct")
    with pytest.raises(InvalidRequestError, match="only supports single tool-calls"):
        t.render(msgs, tools=[WEATHER])


# -- Mistral Nemo ------------------------------------------------------------------------


def test_mistral_nemo_tools_calls_and_results() -> None:
    msgs = [{"role": "system", "content": "Sys"}, *tool_turn(),
            {"role": "assistant", "content": "18 degrees."},
            {"role": "user", "content": "Thanks"}]
    out = compile_fixture("mistral-nemo-instruct").render(msgs, tools=[WEATHER])
    assert out.startswith("<s>[INST]Weather in Paris?[/INST][TOOL_CALLS][{\"name\": "
                          "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": "
                          f"\"{CALL_ID}\"}}]</s>[TOOL_RESULTS]{{\"content\": 18C, "
                          f"\"call_id\": \"{CALL_ID}\"}}[/TOOL_RESULTS]18 degrees.</s>")
    # tools only before the last user message, which carries the system prompt
    assert out.count("[AVAILABLE_TOOLS]") == 1
    assert out.endswith("[/AVAILABLE_TOOLS][INST]Sys\n\nThanks[/INST]")


def test_mistral_nemo_demands_nine_character_ids() -> None:
    msgs = tool_turn()
    msgs[1]["tool_calls"][0]["id"] = "call_1"
    with pytest.raises(InvalidRequestError, match="length 9"):
        compile_fixture("mistral-nemo-instruct").render(msgs, tools=[WEATHER])


# -- thinking templates ------------------------------------------------------------------


def test_qwen3_enable_thinking_flag() -> None:
    t = compile_fixture("qwen3")
    msgs = [{"role": "user", "content": "Hi"}]
    assert t.render(msgs).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert t.render(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_reasoning_content_and_null_content_with_calls() -> None:
    t = compile_fixture("qwen3")
    msgs = [*tool_turn()[:2]]
    msgs[1] = {**msgs[1], "reasoning_content": "\nI should look it up.\n"}
    out = t.render([*msgs, tool_turn()[2]], tools=[WEATHER])
    # null content fails this template (`'</think>' in message.content`): rendered as ""
    assert ('<|im_start|>assistant\n<think>\nI should look it up.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n') in out


def test_qwen3_strips_old_thinking_from_history() -> None:
    t = compile_fixture("qwen3")
    out = t.render([{"role": "user", "content": "A"},
                    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nB"},
                    {"role": "user", "content": "C"}])
    assert "hmm" not in out
    assert "<|im_start|>assistant\nB<|im_end|>\n" in out


def test_deepseek_r1_generation_prompt_opens_thinking() -> None:
    t = compile_fixture("deepseek-r1-distill", bos="<｜begin▁of▁sentence｜>",
                        eos="<｜end▁of▁sentence｜>")
    out = t.render([{"role": "user", "content": "1+1?"},
                    {"role": "assistant", "content": "<think>\nhm\n</think>\n\n2"},
                    {"role": "user", "content": "2+2?"}])
    assert out == ("<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜>\n\n2"
                   "<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>\n")


def test_ministral3_default_system_prompt_and_null_content() -> None:
    t = compile_fixture("ministral-3-reasoning")
    out = t.render(tool_turn(), tools=[WEATHER])
    assert out.startswith("<s>[SYSTEM_PROMPT]# HOW YOU SHOULD THINK AND ANSWER")
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>[TOOL_RESULTS]18C' in out


# -- the environment ---------------------------------------------------------------------


def test_tojson_keeps_unicode_and_takes_indent() -> None:
    t = inline("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ y | tojson }}")
    assert t.render([], x={"a": "é<&>"}, y=[1, None]) == (
        '{"a": "é<&>"}|{\n  "a": "é<&>"\n}|[1, null]')


def test_strftime_now_and_bos_eos() -> None:
    t = inline("{{ bos_token }}{{ strftime_now('%Y') }}{{ eos_token }}")
    assert t.render([]) == f"<s>{datetime.now().year}</s>"


def test_trim_blocks_and_lstrip_blocks() -> None:
    t = inline("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
               "    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) \
        == "[a]\n[b]\n"


def test_loop_controls_and_generation_block() -> None:
    t = inline("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
               "{% if m.role == 'system' %}{% continue %}{% endif %}"
               "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "user", "content": "x"}]
    assert t.render(msgs) == "u"


def test_flags_become_variables_and_tools_none_when_empty() -> None:
    t = inline("{{ custom }}|{{ tools is none }}|{{ add_generation_prompt }}")
    assert t.render([], tools=[], custom="yes") == "yes|True|True"


def test_the_sandbox_is_immutable() -> None:
    t = inline("{{ messages.append(1) }}")
    with pytest.raises(InvalidRequestError, match="chat template failed to render"):
        t.render([])


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(InvalidRequestError, match=r"syntax error at line 2"):
        inline("ok\n{% if %}")
    with pytest.raises(InvalidRequestError, match="syntax error"):
        inline("{% for x in y %}")


def test_render_errors_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequestError, match="chat template failed to render"):
        inline("{{ nothing() }}").render([])
    with pytest.raises(InvalidRequestError, match="TypeError"):
        inline("{{ 'a' + 1 }}").render([])
    with pytest.raises(InvalidRequestError, match="^custom refusal$"):
        inline("{{ raise_exception('custom refusal') }}").render([])
    with pytest.raises(InvalidRequestError, match="failed to render"):
        inline("{{ messages[0]['content'] }}").render([])  # (undefined, then subscripted)


def test_template_variables() -> None:
    assert "enable_thinking" in template_variables(fixture_source("qwen3"))
    assert {"messages", "add_generation_prompt"} <= template_variables(CHATML)
    with pytest.raises(InvalidRequestError):
        template_variables("{% if %}")


def test_chatml_is_llama_cpps_byte_for_byte() -> None:
    import re
    from pathlib import Path

    chat_cpp = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/common/chat.cpp")
    if not chat_cpp.exists():
        pytest.skip("llama.cpp's sources are not on this machine")
    text = chat_cpp.read_text()
    macro = text[text.index("#define CHATML_TEMPLATE_SRC"):]
    macro = macro[:macro.index("\n\n")]
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', macro)
    assert "".join(literals).encode().decode("unicode_escape") == CHATML
