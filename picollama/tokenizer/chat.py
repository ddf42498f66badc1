"""Chat templates: ``tokenizer.chat_template`` rendered in a sandbox with budgets.

A model file's template is untrusted code. It is rendered by Jinja2's
``ImmutableSandboxedEnvironment`` with the globals and filters that Hugging Face's
``apply_chat_template`` provides (``raise_exception``, ``strftime_now``, a ``tojson`` that
does not HTML-escape, ``{% generation %}`` blocks, loop controls), so it renders the same
text as ``transformers``. On top of the sandbox:

- attribute names such as ``__class__``, ``__globals__`` or ``mro`` are refused when the
  template is *parsed* (``TemplateSecurityError``, nothing runs), and again at run time for
  names built dynamically;
- rendering stops with ``TemplateError`` once it has run for ``time_limit_s`` seconds or
  built a string, list or output longer than ``max_output_chars``; the operations that can
  grow data fast (``*``, ``+``, ``**``, ``%``, ``~``, ``str`` methods such as ``center``,
  ``join``, ``replace``, ``format``, and filters) check the size *before* allocating.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator as _CodeGenerator
from jinja2.ext import Extension
from jinja2.sandbox import (
    UNSAFE_ASYNC_GENERATOR_ATTRIBUTES,
    UNSAFE_COROUTINE_ATTRIBUTES,
    UNSAFE_FUNCTION_ATTRIBUTES,
    UNSAFE_GENERATOR_ATTRIBUTES,
    UNSAFE_METHOD_ATTRIBUTES,
    ImmutableSandboxedEnvironment,
)

from picollama.tokenizer.builtin_templates import BUILTIN_TEMPLATES
from picollama.tokenizer.errors import TemplateError, TemplateSecurityError

__all__ = ["ChatTemplate", "BUILTIN_TEMPLATES", "DEFAULT_TEMPLATE"]

# What llama.cpp falls back to when a model has no template.
DEFAULT_TEMPLATE = "chatml"

DEFAULT_MAX_OUTPUT_CHARS = 1 << 22  # 4 Mi characters, far above any context window
DEFAULT_TIME_LIMIT_S = 2.0

_C_SPACE = " \t\n\v\f\r"


class _RenderAborted(BaseException):
    """Raised inside the render to stop it; a BaseException so that no template-side
    ``except Exception`` can swallow it. Converted to ``TemplateError`` at the edge."""


# Attribute names no template may touch, checked statically and at run time.
_FORBIDDEN_NAMES = frozenset(
    {"mro", "format_map"}
    | UNSAFE_FUNCTION_ATTRIBUTES
    | UNSAFE_METHOD_ATTRIBUTES
    | UNSAFE_GENERATOR_ATTRIBUTES
    | UNSAFE_COROUTINE_ATTRIBUTES
    | UNSAFE_ASYNC_GENERATOR_ATTRIBUTES
)

# A printf-style or str.format width/precision: digits runs in format specs.
_DIGITS = re.compile(r"\d+")


def _forbidden(name: str) -> bool:
    return name.startswith("_") or name in _FORBIDDEN_NAMES


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0


class _Budget:
    """Limits of one render: output size, intermediate sizes and a deadline."""

    def __init__(self, max_chars: int, time_limit_s: float):
        self.max_chars = max_chars
        self.deadline = time.monotonic() + time_limit_s
        self.time_limit_s = time_limit_s
        self.events = 0

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise _RenderAborted(
                f"chat template stopped: {what} would be {n} characters or items, over the "
                f"limit of {self.max_chars}"
            )

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _RenderAborted(
                f"chat template stopped: rendering took longer than {self.time_limit_s:g} s"
            )

    def tracer(self, frame: Any, event: str, arg: Any) -> Callable | None:
        # sys.settrace hook: called for every new frame and line while rendering
        self.events += 1
        if self.events & 255 == 0:
            self.check_time()
        return self.tracer


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateSecurityError(f"chat template may not set {name!r} on a namespace")


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationExtension(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (HF marks assistant
    tokens with it; we only need the text)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _GuardedCodeGenerator(_CodeGenerator):
    """Compiles ``a ~ b`` into a size-checked join instead of a plain ``str.join``."""

    def visit_Concat(self, node: Any, frame: Any) -> None:  # noqa: N802 - Jinja's visitor name
        self.write("environment.pl_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with size and time budgets (the budget of the render in progress)."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%", "//"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationExtension, "jinja2.ext.loopcontrols"],
        )
        self.max_chars = max_chars
        # The budget of the render in progress, per thread (renders may run concurrently);
        # size checks outside a render (constant folding at parse time) get no deadline.
        self._local = threading.local()

    @property
    def budget(self) -> _Budget:
        budget = getattr(self._local, "budget", None)
        return budget if budget is not None else _Budget(self.max_chars, math.inf)

    @budget.setter
    def budget(self, value: _Budget | None) -> None:
        self._local.budget = value

    # -- attributes ----------------------------------------------------------------------

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(attr, str) and _forbidden(attr):
            return False
        return super().is_safe_attribute(obj, attr, value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise TemplateSecurityError(
            f"chat template tried to access {attribute!r} of a {type(obj).__name__!r} "
            "object, which the sandbox forbids"
        )

    # -- growth checks -------------------------------------------------------------------

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                budget.check_size((left.bit_length() + right.bit_length()) // 8, "a number")
            elif isinstance(right, int) and _size(left):
                budget.check_size(_size(left) * max(right, 0), "a repeated sequence")
            elif isinstance(left, int) and _size(right):
                budget.check_size(_size(right) * max(left, 0), "a repeated sequence")
        elif operator == "+":
            budget.check_size(_size(left) + _size(right), "a concatenation")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                budget.check_size(int(right * math.log2(abs(left))) // 8, "a power")
        elif operator == "%" and isinstance(left, str):
            self._check_format_spec(left, right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def _check_format_spec(self, spec: str, args: Iterable[Any] = ()) -> None:
        """Refuse printf / str.format widths that would allocate past the budget."""
        for digits in _DIGITS.findall(spec):
            if len(digits) > 9 or int(digits) > self.max_chars:
                self.budget.check_size(10 ** min(len(digits), 12), "a formatted field")
        if "*" in spec:
            for arg in args:
                if isinstance(arg, int):
                    self.budget.check_size(abs(arg), "a formatted field")

    def pl_concat(self, parts: Iterable[Any]) -> str:
        strings = [str(p) for p in parts]
        self.budget.check_size(sum(map(len, strings)), "a ~ concatenation")
        return "".join(strings)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self._check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        __self.budget.check_size(_size(result), "a call's result")
        return result

    def _check_call(self, obj: Any, args: tuple, kwargs: dict) -> None:
        target = getattr(obj, "__wrapped__", obj)  # str.format is wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "")
        if not isinstance(owner, str):
            return
        budget = self.budget
        ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
        if name in ("center", "ljust", "rjust", "zfill") and ints:
            budget.check_size(max(ints), f"str.{name}")
        elif name == "expandtabs":
            budget.check_size(len(owner) * max([8, *ints]), "str.expandtabs")
        elif name == "replace" and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            count = owner.count(old) if old else len(owner) + 1
            budget.check_size(len(owner) + count * max(len(new) - len(old), 0), "str.replace")
        elif name == "join" and args:
            items = list(args[0]) if not isinstance(args[0], (str, list, tuple)) else args[0]
            total = sum(len(str(x)) for x in items) + len(owner) * max(len(items) - 1, 0)
            budget.check_size(total, "str.join")
        elif name in ("format", "format_map"):
            self._check_format_spec(owner, ints)


def _guard_filter(env: _SandboxEnvironment, name: str, func: Callable) -> Callable:
    """A filter that checks its arguments' growth before, and its result's size after."""

    # filters marked pass_context / pass_eval_context / pass_environment get that first
    offset = 1 if hasattr(func, "jinja_pass_arg") else 0

    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = env.budget
        values = list(args[offset:])
        ints = [a for a in (*values, *kwargs.values()) if isinstance(a, int)]
        if name in ("center", "indent", "wordwrap", "truncate") and ints:
            lines = str(values[0]).count("\n") + 1 if values else 1
            budget.check_size(max(ints) * lines, f"the {name} filter")
        elif name == "replace" and len(values) >= 3:
            text, old, new = (str(v) for v in values[:3])
            count = text.count(old) if old else len(text) + 1
            budget.check_size(len(text) + count * max(len(new) - len(old), 0), "replace")
        elif name == "join" and values:
            items = values[0]
            if not isinstance(items, (str, list, tuple)):
                items = values[0] = list(items)
                args = (*args[:offset], *values)
            sep = str(values[1]) if len(values) > 1 else str(kwargs.get("d", ""))
            total = sum(len(str(x)) for x in items) + len(sep) * max(len(items) - 1, 0)
            budget.check_size(total, "join")
        elif name == "format" and values:
            env._check_format_spec(str(values[0]), ints)
        result = func(*args, **kwargs)
        budget.check_size(_size(result), f"the {name} filter's result")
        return result

    if offset:
        guarded.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
    guarded.__name__ = getattr(func, "__name__", name)
    return guarded


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML)."""
    if isinstance(indent, int) and indent > 64:
        raise TemplateError(f"tojson indent {indent} is too large (at most 64)")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: Any) -> None:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    fmt = str(fmt)
    if len(fmt) > 256 or any(len(d) > 3 for d in _DIGITS.findall(fmt)):
        raise TemplateError(f"strftime_now format {fmt[:40]!r} is too long")
    return datetime.now().strftime(fmt)


def _ctrim(value: Any) -> str:
    """llama.cpp's ``trim``: strip C whitespace only."""
    return str(value).strip(_C_SPACE)


def _make_environment(max_chars: int) -> _SandboxEnvironment:
    env = _SandboxEnvironment(max_chars)
    env.filters["tojson"] = _tojson
    env.filters["ctrim"] = _ctrim
    for name, func in list(env.filters.items()):
        env.filters[name] = _guard_filter(env, name, func)
    env.globals.pop("lipsum", None)
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _check_source(env: _SandboxEnvironment, source: str) -> Any:
    """Parse ``source``; refuse forbidden attribute names before anything runs."""
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template syntax error at line {exc.lineno}: {exc.message}"
        ) from None
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            name = node.arg.value
        else:
            continue
        if _forbidden(name):
            raise TemplateSecurityError(
                f"chat template line {node.lineno} accesses {name!r}, which is forbidden"
            )
    return ast


def _plain(value: Any, depth: int = 0) -> Any:
    """Inputs as plain JSON-like data, so no caller object's methods reach the template."""
    if depth > 64:
        raise TemplateError("chat input nests deeper than 64 levels")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item(), depth + 1)
    return f"<{type(value).__name__}>"


def _text_content(content: Any) -> Any:
    """A list content (OpenAI parts) as its text, for the built-in templates."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return "" if content is None else content


class ChatTemplate:
    """A chat template, ready to render conversations.

    ``source`` is Jinja text (a model's ``tokenizer.chat_template``); ``bos_token`` and
    ``eos_token`` are the texts the template sees under those names. Construction parses
    the template and refuses forbidden attribute names; ``render`` runs it within
    ``time_limit_s`` seconds and ``max_output_chars`` characters.
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        *,
        name: str | None = None,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    ):
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, not {type(source).__name__}")
        if len(source) > max_output_chars:
            raise TemplateError(f"chat template is {len(source)} characters, over the limit")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.max_output_chars = max_output_chars
        self.time_limit_s = time_limit_s
        self._env = _make_environment(max_output_chars)
        ast = _check_source(self._env, source)
        try:
            self._template = self._env.from_string(ast)
        except _RenderAborted as exc:  # constant folding hit a size limit
            raise TemplateError(str(exc)) from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"

    # -- construction helpers ------------------------------------------------------------

    @classmethod
    def builtin(cls, name: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """One of llama.cpp's named formats (``chatml``, ``llama3``, ``gemma``, ...)."""
        source = BUILTIN_TEMPLATES.get(name)
        if source is None:
            raise TemplateError(
                f"unknown chat template name {name!r}; built-in names: "
                + ", ".join(sorted(BUILTIN_TEMPLATES))
            )
        return cls(source, bos_token, eos_token, name=name)

    @classmethod
    def for_model(cls, tokenizer_metadata: Any, override_name: str | None = None) -> ChatTemplate:
        """The template for a model: ``override_name`` (a built-in name or Jinja text) if
        given, else the file's ``tokenizer.chat_template``, else ``chatml`` as llama.cpp.

        ``tokenizer_metadata`` is the GGUF metadata mapping (or a ``Tokenizer``).
        """
        is_tokenizer = hasattr(tokenizer_metadata, "token_to_piece")
        metadata = tokenizer_metadata.metadata if is_tokenizer else tokenizer_metadata
        if not isinstance(metadata, Mapping):
            raise TemplateError("for_model needs the GGUF metadata mapping or a Tokenizer")
        bos, eos = _special_texts(tokenizer_metadata, metadata)
        if override_name:
            if override_name in BUILTIN_TEMPLATES:
                return cls.builtin(override_name, bos, eos)
            if "{{" in override_name or "{%" in override_name:
                return cls(override_name, bos, eos, name="custom")
            raise TemplateError(
                f"unknown chat template name {override_name!r}; built-in names: "
                + ", ".join(sorted(BUILTIN_TEMPLATES))
            )
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source:
            return cls(source, bos, eos, name="model")
        return cls.builtin(DEFAULT_TEMPLATE, bos, eos)

    # -- rendering -----------------------------------------------------------------------

    def render(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, Mapping) for m in messages
        ):
            raise TemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
        messages = _plain(list(messages))
        if self.name in BUILTIN_TEMPLATES:
            messages = [
                {**m, "role": str(m.get("role", "")), "content": _text_content(m.get("content"))}
                for m in messages
            ]
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **_plain(kwargs),
            "messages": messages,
            "tools": _plain(tools),
            "documents": _plain(kwargs.get("documents")),
            "add_generation_prompt": bool(add_generation_prompt),
        }
        budget = _Budget(self.max_output_chars, self.time_limit_s)
        self._env.budget = budget
        out: list[str] = []
        total = 0
        previous_tracer = sys.gettrace()
        sys.settrace(budget.tracer)
        try:
            for chunk in self._template.generate(**variables):
                total += len(chunk)
                budget.check_size(total, "the rendered prompt")
                budget.check_time()
                out.append(chunk)
        except _RenderAborted as exc:
            raise TemplateError(str(exc)) from None
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateSecurityError(f"chat template: {exc}") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None
        except RecursionError:
            raise TemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise TemplateError("chat template ran out of memory") from None
        except Exception as exc:  # the template's own errors: a bad key, a type mismatch
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            sys.settrace(previous_tracer)
            self._env.budget = None
        return "".join(out)


def _special_texts(source: Any, metadata: Mapping[str, Any]) -> tuple[str, str]:
    """The BOS and EOS texts a template sees (llama.cpp: ``token_to_piece``, specials shown)."""
    if hasattr(source, "token_to_piece"):  # a Tokenizer
        texts = []
        for tid in (source.bos_id, source.eos_id):
            piece = source.token_to_piece(tid) if tid >= 0 else b""
            texts.append(piece.decode("utf-8", "replace"))
        return texts[0], texts[1]
    # From metadata alone, without building the whole vocabulary: the ids the file names
    # (or the defaults of its tokenizer model), rendered as llama.cpp renders them.
    tokens = metadata.get("tokenizer.ggml.tokens")
    model = metadata.get("tokenizer.ggml.model")
    defaults = {"llama": (1, 2), "gpt2": (11, 11), "bert": (101, -1), "gemma4": (-1, -1)}
    if not isinstance(tokens, list) or model not in defaults:
        return "", ""
    types = metadata.get("tokenizer.ggml.token_type")
    texts = []
    for key, default in zip(("bos", "eos"), defaults[model], strict=True):
        tid = metadata.get(f"tokenizer.ggml.{key}_token_id", default)
        if not isinstance(tid, int) or not 0 <= tid < len(tokens):
            tid = default if 0 <= default < len(tokens) else -1
        if tid < 0:
            texts.append("")
            continue
        text = tokens[tid]
        if types is None or int(types[tid]) == 1:  # a normal token: rendered as text
            if model == "gpt2":
                from picollama.tokenizer.tokenizer import _gpt2_decode

                text = _gpt2_decode(text).decode("utf-8", "replace")
            else:
                text = text.replace("\u2581", " ")
        texts.append(text)
    return texts[0], texts[1]
