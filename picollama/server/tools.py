"""Tool calls (OpenAI ``tools`` / ``tool_choice``) for chat completions.

Two ways, as llama.cpp's chat handlers:

- the model's template knows tools (its source mentions ``tools``): the tools go to the
  template, and tool calls are parsed from the reply in the Hermes / Qwen form
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` or as a bare JSON object;
- otherwise (SmolLM2's template, for one) llama.cpp's "generic" format: a system message
  lists the tools and the reply is constrained by a JSON schema to either
  ``{"tool_call": {"name": ..., "arguments": {...}}}`` or ``{"response": "..."}``, so the
  tool call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from picollama.server.errors import bad_request

__all__ = ["ToolMode"]

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class ToolMode:
    def __init__(self, tools: list[dict], choice: Any, native: bool):
        self.tools = tools
        self.choice = choice  # "auto", "required", or {"type": "function", "function": {...}}
        self.native = native
        self.names = [t["function"]["name"] for t in tools]
        self.template_tools = tools if native else None
        self.schema = None if native else self._generic_schema()

    @classmethod
    def from_request(cls, body: dict, template) -> ToolMode | None:
        tools = body.get("tools")
        choice = body.get("tool_choice", "auto")
        if tools is None or tools == []:
            return None
        if not isinstance(tools, list) or len(tools) > 128:
            raise bad_request("'tools' must be a list of at most 128 tools", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if (
                not isinstance(t, dict)
                or t.get("type", "function") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not fn["name"]
            ):
                raise bad_request(
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                    "tools",
                )
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise bad_request(f"tools[{i}].function.parameters must be an object", "tools")
        if choice == "none":
            return None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in [t["function"]["name"] for t in tools]:
                raise bad_request(f"tool_choice names an unknown tool {name!r}", "tool_choice")
            tools = [t for t in tools if t["function"]["name"] == name]
            choice = "required"
        elif choice not in ("auto", "required"):
            raise bad_request(
                "'tool_choice' must be none, auto, required or a function", "tool_choice"
            )
        native = "tools" in getattr(template, "source", "")
        return cls(tools, choice, native)

    # -- the generic format -----------------------------------------------------------------

    def _generic_schema(self) -> dict:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for t in self.tools
        ]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        tool_call = {
            "type": "object",
            "properties": {"tool_call": call},
            "required": ["tool_call"],
        }
        if self.choice == "required":
            return tool_call
        response = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
        }
        return {"anyOf": [tool_call, response]}

    def rewrite_messages(self, messages: list[dict]) -> list[dict]:
        """Messages for the template: in generic mode, the tools and the reply format go in
        a system message, and earlier tool calls and results become plain text."""
        if self.native:
            return [
                {**m, "content": m["content"] or ""}
                if m.get("content") is None and "tool_calls" not in m
                else m
                for m in messages
            ]
        out = []
        for m in messages:
            content = m.get("content") or ""
            if m.get("role") == "assistant" and m.get("tool_calls"):
                call = m["tool_calls"][0].get("function", {})
                args = call.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                content = json.dumps({"tool_call": {"name": call.get("name"), "arguments": args}})
                out.append({"role": "assistant", "content": content})
            elif m.get("role") == "tool":
                out.append({"role": "tool", "content": json.dumps({"tool_response": content})})
            else:
                out.append({**m, "content": content})
        intro = (
            "You can call these tools:\n"
            + json.dumps([t["function"] for t in self.tools], indent=2)
            + "\n\nRespond in JSON format, either with `tool_call` (a request to call a tool) "
            "or with `response` (a reply to the user's request), following this schema:\n"
            + json.dumps(self.schema, indent=2)
        )
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
        return out

    # -- parsing the reply ------------------------------------------------------------------

    def parse(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message (content and/or tool_calls) and the finish reason."""
        calls: list[dict] = []
        content: str | None = text
        if self.native:
            for m in _TOOL_CALL_RE.finditer(text):
                call = _json(m.group(1))
                if isinstance(call, dict) and "name" in call:
                    calls.append(call)
            if calls:
                content = _TOOL_CALL_RE.sub("", text).strip() or None
            else:
                call = _json(text.strip())
                if isinstance(call, dict) and call.get("name") in self.names:
                    calls, content = [call], None
        else:
            obj = _json(text.strip())
            if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
                calls, content = [obj["tool_call"]], None
            elif isinstance(obj, dict) and isinstance(obj.get("response"), str):
                content = obj["response"]
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        tool_calls = []
        for call in calls:
            args = call.get("arguments", call.get("parameters", {}))
            tool_calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": str(call.get("name")),
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
