"""Built-in chat templates, for models whose file carries none, chosen with ``--chat-template``.

Each one writes the same text as llama.cpp's hard-coded formatter of that name
(``llm_chat_apply_template`` in src/llama-chat.cpp), as Jinja so that it renders through
the same sandbox as a model's own template. ``ctrim`` is llama.cpp's ``trim``: it strips
C whitespace (space, \\t, \\n, \\v, \\f, \\r) only. Message contents reach these templates as
plain strings (text parts of a list content are joined).
"""

from __future__ import annotations

__all__ = ["BUILTIN_TEMPLATES"]

_CHATML = """\
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    content = "message['content'] | ctrim" if strip else "message['content']"
    sys_text = "'<<SYS>>\\n' + content + '\\n<</SYS>>\\n\\n'" if system else "content + '\\n'"
    again = "'<s>[INST] '" if bos_inside else "'[INST] '"
    return f"""\
{{%- set ns = namespace(inside=true) -%}}
{{{{- '[INST] ' -}}}}
{{%- for message in messages -%}}
{{%- set content = {content} -%}}
{{%- if not ns.inside -%}}{{%- set ns.inside = true -%}}{{{{- {again} -}}}}{{%- endif -%}}
{{%- if message['role'] == 'system' -%}}{{{{- {sys_text} -}}}}
{{%- elif message['role'] == 'user' -%}}{{{{- content + ' [/INST]' -}}}}
{{%- else -%}}{{{{- content + '</s>' -}}}}{{%- set ns.inside = false -%}}
{{%- endif -%}}
{{%- endfor -%}}
"""


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> str:
    answer = "message['content'] | ctrim" if trim_assistant else "message['content']"
    return f"""\
{{%- set ns = namespace(inside=false) -%}}
{{%- for message in messages -%}}
{{%- if not ns.inside -%}}{{{{- '{leading}[INST]{trailing}' -}}}}{{%- set ns.inside = true -%}}
{{%- endif -%}}
{{%- if message['role'] == 'system' -%}}{{{{- message['content'] + '\\n\\n' -}}}}
{{%- elif message['role'] == 'user' -%}}{{{{- message['content'] + '{leading}[/INST]' -}}}}
{{%- else -%}}{{{{- '{trailing}' + ({answer}) + '</s>' -}}}}{{%- set ns.inside = false -%}}
{{%- endif -%}}
{{%- endfor -%}}
"""


def _mistral_v7(space: str) -> str:
    return f"""\
{{%- for message in messages -%}}
{{%- if message['role'] == 'system' -%}}
{{{{- '[SYSTEM_PROMPT]{space}' + message['content'] + '[/SYSTEM_PROMPT]' -}}}}
{{%- elif message['role'] == 'user' -%}}{{{{- '[INST]{space}' + message['content'] + '[/INST]' -}}}}
{{%- else -%}}{{{{- '{space}' + message['content'] + '</s>' -}}}}
{{%- endif -%}}
{{%- endfor -%}}
"""


def _per_message(body: str, generation: str = "", prefix: str = "") -> str:
    """A template that writes ``body`` for each message, then ``generation`` if asked."""
    tail = (
        f"{{%- if add_generation_prompt -%}}{{{{- {generation} -}}}}{{%- endif -%}}\n"
        if generation
        else ""
    )
    head = f"{{{{- {prefix} -}}}}\n" if prefix else ""
    return head + "{%- for message in messages -%}\n" + body + "\n{%- endfor -%}\n" + tail


def _by_role(cases: dict[str, str], default: str | None = None) -> str:
    """An if/elif chain over ``message['role']``; ``default`` for any other role."""
    parts = []
    for i, (role, expr) in enumerate(cases.items()):
        keyword = "if" if i == 0 else "elif"
        parts.append(f"{{%- {keyword} message['role'] == '{role}' -%}}{{{{- {expr} -}}}}")
    if default is not None:
        parts.append(f"{{%- else -%}}{{{{- {default} -}}}}")
    parts.append("{%- endif -%}")
    return "\n".join(parts)


_C = "message['content']"
_T = "(message['content'] | ctrim)"
_ROLE = "message['role']"

_GEMMA = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- set ns.system = ns.system + (message['content'] | ctrim) -%}
{%- else -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<start_of_turn>' + role + '\\n' -}}
{%- if ns.system and role != 'model' -%}
{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}
{%- endif -%}
{{- (message['content'] | ctrim) + '<end_of_turn>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

_ORION = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] -%}
{%- elif message['role'] == 'user' -%}
{{- 'Human: ' -}}
{%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}
{{- message['content'] + '\\n\\nAssistant: </s>' -}}
{%- else -%}{{- message['content'] + '</s>' -}}
{%- endif -%}
{%- endfor -%}
"""

_MONARCH = _per_message(
    "{{- ('' if loop.first else '<s>') + message['role'] + '\\n' + message['content']"
    " + '</s>\\n' -}}",
    "'<s>assistant\\n'",
)

_OPENCHAT = _per_message(
    _by_role(
        {"system": f"{_C} + '<|end_of_turn|>'"},
        f"'GPT4 Correct ' + ({_ROLE}[:1] | upper) + {_ROLE}[1:] + ': ' + {_C} + '<|end_of_turn|>'",
    ),
    "'GPT4 Correct Assistant:'",
)


def _vicuna(orca: bool) -> str:
    system = f"'SYSTEM: ' + {_C} + '\\n'" if orca else f"{_C} + '\\n\\n'"
    return _per_message(
        _by_role(
            {
                "system": system,
                "user": f"'USER: ' + {_C} + '\\n'",
                "assistant": f"'ASSISTANT: ' + {_C} + '</s>\\n'",
            }
        ),
        "'ASSISTANT:'",
    )


_GRANITE = _per_message(
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' -}}\n"
    "{%- if message['role'] == 'assistant_tool_call' -%}{{- '<|tool_call|>' -}}{%- endif -%}\n"
    "{{- message['content'] + '<|end_of_text|>\\n' -}}",
    # no newline after the final header: what the llama.cpp we match writes
    "'<|start_of_role|>assistant<|end_of_role|>'",
)

# Name -> Jinja source; the names are llama.cpp's (``LLM_CHAT_TEMPLATES``).
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim_assistant=False),
    "mistral-v3": _mistral("", " ", trim_assistant=True),
    "mistral-v3-tekken": _mistral("", "", trim_assistant=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _per_message(
        f"{{{{- '<|' + {_ROLE} + '|>\\n' + {_C} + '<|end|>\\n' -}}}}", "'<|assistant|>\\n'"
    ),
    "phi4": _per_message(
        f"{{{{- '<|im_start|>' + {_ROLE} + '<|im_sep|>' + {_C} + '<|im_end|>' -}}}}",
        "'<|im_start|>assistant<|im_sep|>'",
    ),
    "falcon3": _per_message(
        f"{{{{- '<|' + {_ROLE} + '|>\\n' + {_C} + '\\n' -}}}}", "'<|assistant|>\\n'"
    ),
    "zephyr": _per_message(
        f"{{{{- '<|' + {_ROLE} + '|>\\n' + {_C} + '<|endoftext|>\\n' -}}}}", "'<|assistant|>\\n'"
    ),
    "monarch": _MONARCH,
    "gemma": _GEMMA,
    "orion": _ORION,
    "openchat": _OPENCHAT,
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _per_message(
        _by_role(
            {
                "system": _C,
                "user": f"'### Instruction:\\n' + {_C} + '\\n'",
                "assistant": f"'### Response:\\n' + {_C} + '\\n<|EOT|>\\n'",
            }
        ),
        "'### Response:\\n'",
    ),
    "deepseek2": _per_message(
        _by_role(
            {
                "system": f"{_C} + '\\n\\n'",
                "user": f"'User: ' + {_C} + '\\n\\n'",
                "assistant": f"'Assistant: ' + {_C} + '<｜end▁of▁sentence｜>'",
            }
        ),
        "'Assistant:'",
    ),
    "deepseek3": _per_message(
        _by_role(
            {
                "system": f"{_C} + '\\n\\n'",
                "user": f"'<｜User｜>' + {_C}",
                "assistant": f"'<｜Assistant｜>' + {_C} + '<｜end▁of▁sentence｜>'",
            }
        ),
        "'<｜Assistant｜>'",
    ),
    "command-r": _per_message(
        _by_role(
            {
                "system": f"'<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + {_T}"
                " + '<|END_OF_TURN_TOKEN|>'",
                "user": f"'<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + {_T} + '<|END_OF_TURN_TOKEN|>'",
                "assistant": f"'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + {_T}"
                " + '<|END_OF_TURN_TOKEN|>'",
            }
        ),
        "'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'",
    ),
    "llama3": _per_message(
        f"{{{{- '<|start_header_id|>' + {_ROLE} + '<|end_header_id|>\\n\\n' + {_T}"
        " + '<|eot_id|>' -}}",
        "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'",
    ),
    "chatglm3": _per_message(
        f"{{{{- '<|' + {_ROLE} + '|>\\n ' + {_C} -}}}}", "'<|assistant|>'", prefix="'[gMASK]sop'"
    ),
    "chatglm4": _per_message(
        f"{{{{- '<|' + {_ROLE} + '|>\\n' + {_C} -}}}}",
        "'<|assistant|>\\n'",
        prefix="'[gMASK]<sop>'",
    ),
    "glmedge": _per_message(f"{{{{- '<|' + {_ROLE} + '|>\\n' + {_C} -}}}}", "'<|assistant|>'"),
    "minicpm": _per_message(_by_role({"user": f"'<用户>' + {_T} + '<AI>'"}, _T)),
    "exaone3": _per_message(
        _by_role(
            {
                "system": f"'[|system|]' + {_T} + '[|endofturn|]\\n'",
                "user": f"'[|user|]' + {_T} + '\\n'",
                "assistant": f"'[|assistant|]' + {_T} + '[|endofturn|]\\n'",
            }
        ),
        "'[|assistant|]'",
    ),
    "granite": _GRANITE,
    "megrez": _per_message(
        f"{{{{- '<|role_start|>' + {_ROLE} + '<|role_end|>' + {_C} + '<|turn_end|>' -}}}}",
        "'<|role_start|>assistant<|role_end|>'",
    ),
    "llama4": _per_message(
        f"{{{{- '<|header_start|>' + {_ROLE} + '<|header_end|>\\n\\n' + {_T} + '<|eot|>' -}}}}",
        "'<|header_start|>assistant<|header_end|>\\n\\n'",
    ),
    "smolvlm": _per_message(
        _by_role(
            {
                "system": f"{_C} + '\\n\\n'",
                "user": f"'User: ' + {_C} + '<end_of_utterance>\\n'",
            },
            f"'Assistant: ' + {_C} + '<end_of_utterance>\\n'",
        ),
        "'Assistant:'",
        prefix="'<|im_start|>'",
    ),
}
