"""Chat templates: parity with transformers and llama.cpp (frozen), sandbox and budgets.

tests/data/tokenizer/chat_expected.json holds, for a few conversations, what
``transformers``' ``apply_chat_template`` renders for the templates inside GGUF files, what
llama.cpp's own Jinja engine renders for SmolLM2, and what each llama.cpp built-in format
writes (see gen_expected.py).
"""

from __future__ import annotations

import functools
import json
import time
import tracemalloc
from pathlib import Path

import pytest

from picollama.gguf import GGUFReader
from picollama.tokenizer import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    TemplateError,
    TemplateSecurityError,
    Tokenizer,
)

DATA = Path(__file__).parent / "data"
SMOLLM2 = "smollm2-135m-instruct-q4_1"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


@functools.cache
def _expected() -> dict:
    return json.loads((DATA / "tokenizer" / "chat_expected.json").read_text(encoding="utf-8"))


@functools.cache
def _metadata(name: str) -> dict:
    if name.endswith(".gguf"):
        path = DATA / "vocab" / name
    else:
        from picollama.models.registry import ModelNotFoundError, resolve_model_path

        try:
            path = resolve_model_path(name)
        except ModelNotFoundError:
            pytest.skip(f"model {name} is not installed: picollama-models pull {name}")
    with GGUFReader(path) as reader:
        return {k: v for k, v in reader.metadata.items() if k.startswith("tokenizer.")}


def _template_cases(source: str) -> list:
    params = []
    for name, entry in _expected()[source].items():
        cases = entry["cases"] if isinstance(entry, dict) else entry
        marks = [] if name.endswith(".gguf") else [pytest.mark.model]
        for i, case in enumerate(cases):
            params.append(pytest.param(name, case, id=f"{name}-{i}", marks=marks))
    return params


# -- parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, case", _template_cases("transformers"))
def test_model_template_renders_like_transformers(name, case):
    template = ChatTemplate.for_model(_metadata(name))
    specials = _expected()["transformers"][name]["special_tokens"]
    assert template.bos_token == specials["bos_token"]
    assert template.eos_token == specials["eos_token"]
    got = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["expected"]


@pytest.mark.parametrize("name, case", _template_cases("llama_cpp_jinja"))
def test_model_template_renders_like_llama_cpp(name, case):
    if case["messages"][-1]["role"] == "assistant":
        # llama-server treats a final assistant message as a prefill to continue (a server
        # feature, not template rendering); transformers' parity covers these conversations.
        return
    template = ChatTemplate.for_model(_metadata(name))
    got = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["expected"]


def _builtin_cases() -> list:
    return [
        pytest.param(name, case, id=f"{name}-{i}")
        for name, cases in _expected()["llama_cpp_builtin"].items()
        for i, case in enumerate(cases)
    ]


@pytest.mark.parametrize("name, case", _builtin_cases())
def test_builtin_template_matches_llama_cpp(name, case):
    got = ChatTemplate.builtin(name).render(
        case["messages"], add_generation_prompt=case["add_generation_prompt"]
    )
    assert got == case["expected"]


def test_every_builtin_has_llama_cpp_data():
    assert set(_expected()["llama_cpp_builtin"]) == set(BUILTIN_TEMPLATES)
    assert {"chatml", "llama2", "llama3", "mistral-v7", "gemma", "phi3"} <= set(BUILTIN_TEMPLATES)


# -- choosing a template -------------------------------------------------------------------------


def test_for_model_without_template_uses_chatml():
    md = dict(_metadata("ggml-vocab-llama-spm.gguf"))
    assert "tokenizer.chat_template" not in md
    template = ChatTemplate.for_model(md)
    assert template.name == "chatml"
    assert template.bos_token == "<s>" and template.eos_token == "</s>"


def test_for_model_override_by_name_and_by_source():
    md = _metadata("ggml-vocab-qwen2.gguf")
    assert ChatTemplate.for_model(md, override_name="llama3").name == "llama3"
    custom = ChatTemplate.for_model(md, override_name="{{ messages[0]['content'] }}!")
    assert custom.render([{"role": "user", "content": "x"}]) == "x!"
    with pytest.raises(TemplateError, match="unknown chat template name 'nope'.*chatml"):
        ChatTemplate.for_model(md, override_name="nope")


def test_for_model_accepts_a_tokenizer():
    md = _metadata("ggml-vocab-phi-3.gguf")
    tok = Tokenizer.from_metadata(md)
    assert ChatTemplate.for_model(tok).source == ChatTemplate.for_model(md).source


def test_unknown_builtin_lists_names():
    with pytest.raises(TemplateError, match="built-in names: .*gemma"):
        ChatTemplate.builtin("gemma-7")


# -- HF globals and filters ----------------------------------------------------------------------


def test_raise_exception_message_reaches_the_caller():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(TemplateError, match="^Conversation roles must alternate$"):
        template.render(MESSAGES)


def test_tojson_does_not_escape_html_and_keeps_unicode():
    tools = [{"name": "f<x>", "description": "l'été & co"}]
    out = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}").render(
        MESSAGES, tools=tools
    )
    assert out == json.dumps(tools, ensure_ascii=False) + "|" + json.dumps(
        tools, ensure_ascii=False, indent=2
    )


def test_strftime_now_and_extra_variables():
    out = ChatTemplate("{{ strftime_now('%Y') }} {{ enable_thinking }} {{ bos_token }}", "<s>")
    assert out.render(MESSAGES, enable_thinking=False) == f"{time.strftime('%Y')} False <s>"


def test_generation_block_and_loop_controls():
    src = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    )
    assert ChatTemplate(src).render(MESSAGES) == "[Hi!][Hello.]"


def test_add_generation_prompt_and_tools_are_visible():
    src = "{{ add_generation_prompt }} {{ tools is none }} {{ messages | length }}"
    assert ChatTemplate(src).render(MESSAGES) == "True True 4"
    assert ChatTemplate(src).render(MESSAGES, False, tools=[{}]) == "False False 4"


def test_syntax_error_names_the_line():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}")


def test_bad_messages_are_a_clear_error():
    with pytest.raises(TemplateError, match="messages must be a list"):
        ChatTemplate.builtin("chatml").render("hello")  # type: ignore[arg-type]
    with pytest.raises(TemplateError, match="KeyError|UndefinedError|failed"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(MESSAGES)


def test_builtins_accept_list_contents():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]
    out = ChatTemplate.builtin("chatml").render(messages)
    assert out == ChatTemplate.builtin("chatml").render([{"role": "user", "content": "ab"}])


# -- security ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__ }}",
        "{{ joiner.__init__.__globals__['__builtins__'] }}",
        "{{ messages['__class__'] }}",
        "{{ dict.mro() }}",
        "{% if messages.__class__ %}x{% endif %}",
    ],
)
def test_forbidden_attributes_are_refused_before_running(source):
    # the template would raise TemplateError('ran') if any of it ran
    with pytest.raises(TemplateSecurityError):
        ChatTemplate("{{ raise_exception('ran') }}" + source)


@pytest.mark.parametrize(
    "source",
    [
        "{% set a = '__cla' ~ 'ss__' %}{{ messages[a] }}",
        "{{ messages | attr('__class__') }}",
        "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
        "{% set n = '_' * 2 ~ 'globals' ~ '_' * 2 %}{{ cycler.__init__ if false }}{{ cycler[n] }}",
    ],
)
def test_forbidden_attributes_built_at_run_time_are_refused(source):
    with pytest.raises(TemplateSecurityError):
        ChatTemplate(source).render(MESSAGES)


def test_input_objects_are_plain_data():
    class Sneaky(dict):
        def leak(self):
            return "leaked"

    message = Sneaky(role="user", content="hi")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0].leak() }}").render([message])


# -- budgets ------------------------------------------------------------------------------------


def test_endless_loop_is_stopped_by_the_time_budget():
    src = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = ChatTemplate(src, time_limit_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="longer than 0.5 s"):
        template.render(MESSAGES)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'A' * 1000000000 }}",
        "{{ 'A' * 10**9 }}",
        "{{ ['A'] * 10**9 }}",
        "{% set s = namespace(v='ab') %}{% for i in range(64) %}{% set s.v = s.v ~ s.v %}"
        "{% endfor %}{{ s.v }}",
        "{% set s = namespace(v='ab') %}{% for i in range(64) %}{% set s.v = s.v + s.v %}"
        "{% endfor %}{{ s.v }}",
        "{{ 'a' | center(1000000000) }}",
        "{{ 'a' | indent(1000000000, true) }}",
        "{{ 'ab'.ljust(10**9) }}",
        "{{ 'ab'.zfill(10**9) }}",
        "{{ '%01000000000d' % 1 }}",
        "{{ '%*d' % (1000000000, 1) }}",
        "{{ '{:>1000000000}'.format(1) }}",
        "{{ '%1000000000s' | format('x') }}",
        "{{ ('x' * 1000000) | replace('x', 'yyyyyyyyyy') }}",
        "{{ ('x' * 1000000).replace('x', 'yyyyyyyyyy') }}",
        "{{ (['x' * 1000000] * 10) | join }}",
        "{{ ','.join(['x' * 1000000] * 10) }}",
        "{{ 7 ** 100000000 }}",
        "{% set x = namespace(v=2) %}{% for i in range(40) %}{% set x.v = x.v * x.v %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "{{ tools | tojson(indent=1000000) }}",
    ],
)
def test_huge_strings_are_stopped_before_they_are_built(source):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match="stopped|too large|longer"):
            ChatTemplate(source).render(MESSAGES, tools=[{"a": [1, 2, 3]}])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, peak


def test_deep_recursion_is_a_template_error():
    src = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    with pytest.raises(TemplateError, match="recursed too deeply"):
        ChatTemplate(src).render(MESSAGES)


def test_output_budget_is_configurable():
    template = ChatTemplate("{{ 'x' * 2000 }}", max_output_chars=1000)
    with pytest.raises(TemplateError, match="over the limit of 1000"):
        template.render(MESSAGES)
    assert len(ChatTemplate("{{ 'x' * 2000 }}").render(MESSAGES)) == 2000


def test_budgets_do_not_leak_into_the_next_render():
    template = ChatTemplate.builtin("chatml")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 'a' * 10**9 }}").render(MESSAGES)
    assert template.render(MESSAGES).endswith("<|im_start|>assistant\n")
