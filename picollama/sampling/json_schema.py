"""JSON schema to GBNF, in the manner of llama.cpp's ``json_schema_to_grammar``.

The grammar accepts a subset of the JSON documents the schema accepts, never more:

- objects list their properties in schema order, required ones first as in llama.cpp,
  and take no other property unless ``additionalProperties`` says so (llama.cpp's default:
  faster grammars and fewer made-up keys);
- numbers have at most 16 integer and 16 fraction digits; whitespace is bounded;
- ``pattern`` follows ``picollama.sampling.regex`` (search semantics: an unanchored
  pattern may be surrounded by any text), with characters written JSON-escaped;
- integer bounds are exact; number bounds keep the numbers written without an exponent
  whose value is inside them;
- formats ``date`` (real calendar days, leap days left out), ``time``, ``date-time``,
  ``uuid``, ``email`` and ``ipv4`` produce strings their checkers accept.

What the grammar cannot guarantee is a ``SchemaError`` naming the schema path
(``$.properties.tags.uniqueItems``) instead of silently allowing more. ``strict=False``
ignores the keywords a grammar cannot enforce (``uniqueItems``, ``multipleOf``, ``not``,
``if``/``then``/``else``, ``contains``...) as llama.cpp does; unsupported patterns and
formats, unresolvable or cyclic ``$ref`` and impossible bounds stay errors either way.

Supported: ``type`` (one or a list), ``properties``, ``required``, ``additionalProperties``,
``enum``, ``const``, ``items`` (schema or legacy tuple), ``prefixItems``,
``additionalItems``, ``minItems``/``maxItems``, ``minLength``/``maxLength``, ``pattern``,
``format``, ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``, ``$ref`` to
``#...`` JSON pointers (``$defs``, ``definitions``) with recursion through objects and
arrays, ``anyOf``, ``oneOf`` (as ``anyOf``), ``allOf`` (merged), ``minProperties`` /
``maxProperties`` where the properties already satisfy them; annotations are ignored.

Limits: ``MAX_SCHEMA_CHARS`` of schema text, ``MAX_SCHEMA_DEPTH`` nested subschemas,
``MAX_SCHEMA_NODES`` subschemas visited, ``MAX_ENUM`` enum values, lengths and item counts
up to 2^31 (written as chunked repetitions, so ``maxLength`` 65536 is a small grammar).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from picollama.sampling.gbnf import GrammarError, gbnf_literal
from picollama.sampling.regex import RegexCompiler, RegexError, repeat_gbnf

__all__ = [
    "SchemaError",
    "schema_to_gbnf",
    "MAX_SCHEMA_CHARS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "MAX_ENUM",
]

MAX_SCHEMA_CHARS = 1 << 20  # characters of a schema given as text
MAX_SCHEMA_DEPTH = 64  # nested subschemas
MAX_JSON_DEPTH = 256  # nesting of the schema document itself
MAX_SCHEMA_NODES = 20000  # subschemas visited
MAX_ENUM = 10000  # enum values
MAX_COUNT = 1 << 31  # largest length / item count bound
_MAX_DIGITS = 16  # digits of unbounded integer parts, as llama.cpp's integral-part


class SchemaError(GrammarError):
    """A schema that cannot become a grammar; ``path`` is where (``$.properties.x``)."""

    def __init__(self, message: str, path: str = "$"):
        self.path = path
        super().__init__(f"{path}: {message}")


SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'

_PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": (
        '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
        ("integral-part", "decimal-part"),
    ),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "value": (
        "object | array | string | number | boolean | null",
        ("object", "array", "string", "number", "boolean", "null"),
    ),
    "object": (
        '"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
        ("string", "value"),
    ),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": (
        '"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
        '[0-9a-fA-F]{12} "\\""',
        (),
    ),
    # a JSON string character; \u escapes leave out surrogates, so one rule is one character
    "char": (
        '[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\/bfnrt] | "u" '
        "([0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}))",
        (),
    ),
    "string": ('"\\"" char* "\\""', ("char",)),
    "key-char": ('[^"\\\\\\x7F\\x00-\\x1F]', ()),
    "null": ('"null"', ()),
    # formats
    "date": (
        '[0-9]{4} "-" ( ("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | '
        '("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | '
        '"02" "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]) )',
        (),
    ),
    "time": (
        '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
        '( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
        (),
    ),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\""', ("date",)),
    "time-string": ('"\\"" time "\\""', ("time",)),
    "date-time-string": ('"\\"" date-time "\\""', ("date-time",)),
    "email-label": ("[a-zA-Z0-9] ([a-zA-Z0-9-]{0,61} [a-zA-Z0-9])?", ()),
    "email-string": (
        '"\\"" [a-zA-Z0-9_+-]{1,64} ("." [a-zA-Z0-9_+-]{1,64}){0,4} "@" email-label '
        '("." email-label){1,4} "\\""',
        ("email-label",),
    ),
    "ipv4-octet": ('[0-9] | [1-9] [0-9] | "1" [0-9] [0-9] | "2" [0-4] [0-9] | "25" [0-5]', ()),
    "ipv4-string": (
        '"\\"" ipv4-octet "." ipv4-octet "." ipv4-octet "." ipv4-octet "\\""',
        ("ipv4-octet",),
    ),
}
_FORMATS = {
    "date": "date-string",
    "time": "time-string",
    "date-time": "date-time-string",
    "uuid": "uuid",
    "email": "email-string",
    "ipv4": "ipv4-string",
}
_RESERVED = {"root", "space", *_PRIMITIVES}

_ANNOTATIONS = {
    "title", "description", "$schema", "$id", "id", "$comment", "examples", "example",
    "default", "readOnly", "writeOnly", "deprecated", "$defs", "definitions",
    "contentEncoding", "contentMediaType", "contentSchema", "$anchor", "$dynamicAnchor",
    "$vocabulary", "nullable", "discriminator", "xml", "externalDocs", "strict",
}  # fmt: skip
_SUPPORTED = {
    "type", "properties", "required", "additionalProperties", "enum", "const", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "$ref", "anyOf", "oneOf", "allOf", "minProperties", "maxProperties", "uniqueItems",
}  # fmt: skip
# validation keywords a grammar cannot enforce: errors unless strict=False
_UNSUPPORTED = {
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "patternProperties", "propertyNames", "contains", "minContains", "maxContains",
    "unevaluatedProperties", "unevaluatedItems", "multipleOf", "$dynamicRef",
    "$recursiveRef", "$recursiveAnchor",
}  # fmt: skip
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_OBJECT_KEYS = {"properties", "additionalProperties", "required", "minProperties"}
_OBJECT_KEYS |= {"maxProperties"}
_ARRAY_KEYS = {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}
_STRING_KEYS = {"pattern", "format", "minLength", "maxLength"}
_NUMBER_KEYS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_INVALID_NAME = re.compile(r"[^a-zA-Z0-9-]+")
_IDENT = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")


def _path(parts: tuple) -> str:
    out = ["$"]
    for p in parts:
        if isinstance(p, int):
            out.append(f"[{p}]")
        elif _IDENT.match(p):
            out.append("." + p)
        else:
            out.append("[" + json.dumps(p, ensure_ascii=False) + "]")
    return "".join(out)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check_document(schema: Any) -> None:
    """Depth of the schema document, checked without recursion."""
    stack = [(schema, 1)]
    n = 0
    while stack:
        node, depth = stack.pop()
        n += 1
        if depth > MAX_JSON_DEPTH:
            raise SchemaError(f"schema nested deeper than {MAX_JSON_DEPTH}")
        if n > 50 * MAX_SCHEMA_NODES:
            raise SchemaError("schema is too large")
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _text_depth(text: str) -> int:
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


# -- integer ranges -------------------------------------------------------------------------------


def _digits_range(a: str, b: str) -> str:
    """Digit strings of one length from ``a`` to ``b`` (a <= b)."""
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    prefix = f'"{a[:i]}"' if i else ""
    a, b = a[i:], b[i:]
    if not a:
        return prefix
    n = len(a)
    if n == 1:
        return " ".join(p for p in (prefix, f"[{a}-{b}]") if p)
    rest = "[0-9]" if n == 2 else f"[0-9]{{{n - 1}}}"
    zeros, nines = "0" * (n - 1), "9" * (n - 1)
    alts = []
    lo_digit, hi_digit = int(a[0]), int(b[0])
    if a[1:] != zeros:
        alts.append(f'"{a[0]}" ({_digits_range(a[1:], nines)})')
        lo_digit += 1
    last = None
    if b[1:] != nines:
        last = f'"{b[0]}" ({_digits_range(zeros, b[1:])})'
        hi_digit -= 1
    if lo_digit <= hi_digit:
        alts.append(f"[{lo_digit}-{hi_digit}] {rest}")
    if last:
        alts.append(last)
    body = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
    return " ".join(p for p in (prefix, body) if p)


def _natural_range(lo: int, hi: int | None) -> str:
    """Non-negative integers lo..hi without leading zeros (hi None: up to 16 digits)."""
    if hi is None:
        hi = max(10**_MAX_DIGITS - 1, 10 ** len(str(lo)) - 1)
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(hi, 10**n - 1)
        if a <= b:
            alts.append(_digits_range(str(a), str(b)))
    return " | ".join(alts)


def _integer_range(lo: int | None, hi: int | None) -> str:
    """Integers lo..hi (None: unbounded, up to 16 digits) as a GBNF alternation."""
    parts = []
    if lo is None or lo < 0:
        mag_hi = None if lo is None else -lo
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        if mag_hi is None or mag_lo <= mag_hi:
            parts.append(f'"-" ({_natural_range(mag_lo, mag_hi)})')
    if hi is None or hi >= 0:
        parts.append(_natural_range(0 if lo is None else max(lo, 0), hi))
    return " | ".join(parts)


# -- the converter ---------------------------------------------------------------------------


class _Converter:
    def __init__(self, root: Any, strict: bool):
        self.root = root
        self.strict = strict
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.regex = RegexCompiler(self.rules, json_string=True)
        self.n_visits = 0
        self._resolving: dict[str, int] = {}  # $ref -> structure depth when entered
        self._ref_rules: dict[str, str] = {}
        self.structure_depth = 0
        self.depth = 0

    def error(self, message: str, path: tuple) -> SchemaError:
        return SchemaError(message, _path(path))

    # -- rules ---------------------------------------------------------------------------------

    def add_rule(self, name: str, body: str) -> str:
        name = _INVALID_NAME.sub("-", name) or "rule"
        if name not in self.rules or self.rules[name] == body:
            self.rules[name] = body
            return name
        i = 0
        while f"{name}{i}" in self.rules and self.rules[f"{name}{i}"] != body:
            i += 1
        self.rules[f"{name}{i}"] = body
        return f"{name}{i}"

    def primitive(self, name: str) -> str:
        body, deps = _PRIMITIVES[name]
        self.rules[name] = body
        for dep in deps:
            if dep not in self.rules:
                self.primitive(dep)
        return name

    # -- dispatch --------------------------------------------------------------------------------

    def visit(self, schema: Any, name: str, path: tuple) -> str:
        self.n_visits += 1
        if self.n_visits > MAX_SCHEMA_NODES:
            raise self.error(f"schema has more than {MAX_SCHEMA_NODES} subschemas", path)
        if self.depth >= MAX_SCHEMA_DEPTH:
            raise self.error(f"schema nested deeper than {MAX_SCHEMA_DEPTH}", path)
        self.depth += 1
        try:
            return self._visit(schema, name, path)
        finally:
            self.depth -= 1

    def _visit(self, schema: Any, name: str, path: tuple) -> str:
        rule_name = name + "-" if name in _RESERVED else (name or "root")
        if schema is True or (isinstance(schema, Mapping) and not self._constraining(schema)):
            return self.add_rule(rule_name, self.primitive("value"))
        if schema is False:
            raise self.error("the schema 'false' allows no value", path)
        if not isinstance(schema, Mapping):
            raise self.error(f"a schema must be an object or a boolean, got {schema!r:.40}", path)
        self._check_keywords(schema, path)
        sub = name + "-" if name else ""

        if "$ref" in schema:
            others = self._constraining(schema) - {"$ref"}
            if others:
                if self.strict or others & {"type", "properties", "items", "enum", "const"}:
                    raise self.error(f"$ref with sibling keywords {sorted(others)}", path)
            return self.add_rule(rule_name, self.resolve_ref(schema["$ref"], path + ("$ref",)))

        for key in ("anyOf", "oneOf"):
            if key in schema:
                alts = schema[key]
                if not isinstance(alts, list) or not alts:
                    raise self.error(f"{key} must be a non-empty list", path + (key,))
                others = self._constraining(schema) - {key}
                if others:
                    # A and (B or C) == (A and B) or (A and C), merged per alternative
                    alts = [self.merge([{k: schema[k] for k in others}, a], path) for a in alts]
                rules = [
                    self.visit(a, f"{sub or 'alternative-'}{i}", path + (key, i))
                    for i, a in enumerate(alts)
                ]
                return self.add_rule(rule_name, " | ".join(rules))

        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or not parts:
                raise self.error("allOf must be a non-empty list", path + ("allOf",))
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            merged = self.merge([rest] + list(parts), path + ("allOf",))
            return self.visit(merged, name, path)

        types = schema.get("type")
        if "const" in schema:
            return self.add_rule(rule_name, self.constant(schema["const"], types, path))
        if "enum" in schema:
            return self.add_rule(rule_name, self.enumeration(schema, types, path))

        if types is None:
            types = self._infer_types(schema)
        if isinstance(types, list):
            if not types or any(t not in _TYPES for t in types):
                raise self.error(f"invalid type list {types!r}", path + ("type",))
            if len(types) == 1:
                types = types[0]
            else:
                rules = [
                    self.visit({**schema, "type": t}, f"{sub}{t}", path)
                    for t in dict.fromkeys(types)
                ]
                return self.add_rule(rule_name, " | ".join(rules))
        if types is None:
            return self.add_rule(rule_name, self.primitive("value"))
        if types not in _TYPES:
            raise self.error(f"unknown type {types!r}", path + ("type",))

        if types == "object":
            return self.add_rule(rule_name, self.object_rule(schema, name, path))
        if types == "array":
            return self.add_rule(rule_name, self.array_rule(schema, name, path))
        if types == "string":
            return self.string_rule(schema, rule_name, path)
        if types == "integer":
            return self.add_rule(rule_name, self.integer_rule(schema, path))
        if types == "number":
            return self.add_rule(rule_name, self.number_rule(schema, path))
        return self.add_rule(rule_name, self.primitive(types))

    def _constraining(self, schema: Mapping) -> set[str]:
        keys = set(schema) - _ANNOTATIONS
        if not self.strict:
            keys -= _UNSUPPORTED
        return {k for k in keys if k in _SUPPORTED or k in _UNSUPPORTED}

    def _check_keywords(self, schema: Mapping, path: tuple) -> None:
        if not self.strict:
            return
        for key in schema:
            if key in _UNSUPPORTED:
                raise self.error(f"keyword {key!r} cannot be enforced by a grammar", path + (key,))
        if schema.get("uniqueItems") is True:
            max_items = schema.get("maxItems")
            if not (isinstance(max_items, int) and max_items <= 1):
                raise self.error(
                    "uniqueItems cannot be enforced by a grammar", path + ("uniqueItems",)
                )

    def _infer_types(self, schema: Mapping) -> list[str] | str | None:
        keys = set(schema)
        found = []
        if keys & _OBJECT_KEYS:
            found.append("object")
        if keys & _ARRAY_KEYS:
            found.append("array")
        if keys & _STRING_KEYS:
            found.append("string")
        if keys & _NUMBER_KEYS:
            found.append("number")
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    # -- $ref and allOf ---------------------------------------------------------------------

    def _pointer(self, ref: Any, path: tuple) -> tuple[Any, tuple]:
        if not isinstance(ref, str):
            raise self.error(f"$ref must be a string, got {ref!r:.40}", path)
        if not ref.startswith("#"):
            raise self.error(f"$ref {ref!r}: only local references ('#...') are supported", path)
        target: Any = self.root
        target_path: tuple = ()
        frag = ref[1:]
        if frag and not frag.startswith("/"):
            raise self.error(f"$ref {ref!r}: anchors are not supported", path)
        for raw in frag.split("/")[1:] if frag else []:
            part = raw.replace("~1", "/").replace("~0", "~")
            part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part)
            if isinstance(target, Mapping) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
                part = int(part)
            else:
                raise self.error(f"$ref {ref!r} does not resolve", path)
            target_path += (part,)
        return target, target_path

    def resolve_ref(self, ref: Any, path: tuple) -> str:
        target, target_path = self._pointer(ref, path)
        got = self._ref_rules.get(ref)
        if got is not None:
            return got
        if ref in self._resolving:
            if self._resolving[ref] == self.structure_depth:
                raise self.error(f"$ref {ref!r} refers to itself without nesting (a cycle)", path)
            # recursion through an object or array: refer to the rule being built
            return "ref" + _INVALID_NAME.sub("-", ref[1:]).rstrip("-")
        name = "ref" + _INVALID_NAME.sub("-", ref[1:]).rstrip("-")
        self._resolving[ref] = self.structure_depth
        try:
            rule = self.visit(target, name, target_path)
        finally:
            del self._resolving[ref]
        if rule != name:
            self.rules[name] = rule
        self._ref_rules[ref] = name
        return name

    def merge(self, parts: list, path: tuple, seen: frozenset = frozenset()) -> dict:
        """One schema for allOf ``parts`` (resolving their $refs), or a SchemaError."""
        out: dict[str, Any] = {}
        for i, part in enumerate(parts):
            if part is True:
                continue
            if part is False:
                raise self.error("allOf contains 'false': no value is allowed", path)
            if not isinstance(part, Mapping):
                raise self.error(f"allOf item {i} is not a schema", path + (i,))
            part = dict(part)
            if "$ref" in part:
                ref = part.pop("$ref")
                if ref in seen:
                    raise self.error(f"$ref {ref!r} cycle inside allOf", path)
                target, _ = self._pointer(ref, path)
                part = self.merge([target, part], path, seen | {ref})
            if "allOf" in part:
                inner = part.pop("allOf")
                if not isinstance(inner, list):
                    raise self.error("allOf must be a list", path)
                part = self.merge([part] + inner, path, seen)
            for key, value in part.items():
                if key in _ANNOTATIONS or key not in out:
                    if key not in out:
                        out[key] = value
                    continue
                out[key] = self._merge_key(key, out[key], value, path)
        return out

    def _merge_key(self, key: str, a: Any, b: Any, path: tuple) -> Any:
        if a == b:
            return a
        if key == "properties" and isinstance(a, Mapping) and isinstance(b, Mapping):
            merged = dict(a)
            for k, v in b.items():
                merged[k] = self.merge([merged[k], v], path + ("properties", k)) if k in a else v
            return merged
        if key == "required" and isinstance(a, list) and isinstance(b, list):
            return list(dict.fromkeys(a + b))
        if key == "type":
            ta = set(a if isinstance(a, list) else [a])
            tb = set(b if isinstance(b, list) else [b])
            if "number" in ta and "integer" in tb:
                ta.add("integer")
            if "number" in tb and "integer" in ta:
                tb.add("integer")
            both = [t for t in _TYPES if t in ta and t in tb]
            if not both:
                raise self.error(f"allOf types {a!r} and {b!r} do not intersect", path)
            return both if len(both) > 1 else both[0]
        if key == "enum" and isinstance(a, list) and isinstance(b, list):
            both = [v for v in a if v in b]
            if not both:
                raise self.error("allOf enums have no value in common", path)
            return both
        if key in ("minimum", "minLength", "minItems", "minProperties", "exclusiveMinimum"):
            if isinstance(a, int | float) and isinstance(b, int | float):
                return max(a, b)
        if key in ("maximum", "maxLength", "maxItems", "maxProperties", "exclusiveMaximum"):
            if isinstance(a, int | float) and isinstance(b, int | float):
                return min(a, b)
        if key in ("anyOf", "oneOf"):
            return [self.merge([x, y], path) for x in a for y in b]
        raise self.error(f"allOf has conflicting {key!r} values", path)

    # -- values --------------------------------------------------------------------------------

    def constant(self, value: Any, types: Any, path: tuple) -> str:
        self._check_type(value, types, path + ("const",))
        try:
            return gbnf_literal(_dump(value))
        except (TypeError, ValueError) as err:
            raise self.error(f"const is not JSON: {err}", path + ("const",)) from None

    def enumeration(self, schema: Mapping, types: Any, path: tuple) -> str:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise self.error("enum must be a non-empty list", path + ("enum",))
        if len(values) > MAX_ENUM:
            raise self.error(f"enum has more than {MAX_ENUM} values", path + ("enum",))
        kept = [v for v in values if types is None or self._has_type(v, types)]
        if not kept:
            raise self.error("no enum value has the schema's type", path + ("enum",))
        try:
            alts = list(dict.fromkeys(gbnf_literal(_dump(v)) for v in kept))
        except (TypeError, ValueError) as err:
            raise self.error(f"enum value is not JSON: {err}", path + ("enum",)) from None
        return "(" + " | ".join(alts) + ")"

    @staticmethod
    def _has_type(value: Any, types: Any) -> bool:
        allowed = types if isinstance(types, list) else [types]
        t = _json_type(value)
        return t in allowed or (t == "integer" and "number" in allowed)

    def _check_type(self, value: Any, types: Any, path: tuple) -> None:
        if types is not None and not self._has_type(value, types):
            raise self.error(f"value {value!r:.40} does not have type {types!r}", path)

    # -- objects -------------------------------------------------------------------------------

    def object_rule(self, schema: Mapping, name: str, path: tuple) -> str:
        props = schema.get("properties", {})
        if not isinstance(props, Mapping):
            raise self.error("properties must be an object", path + ("properties",))
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.error("required must be a list of strings", path + ("required",))
        additional = schema.get("additionalProperties")
        if additional is not None and not isinstance(additional, bool | Mapping):
            raise self.error("additionalProperties must be a boolean or a schema", path)
        if additional is None and not props and not required:
            additional = True  # {"type": "object"}: any object
        props = dict(props)
        for r in required:
            if r not in props:
                if additional is False:
                    raise self.error(
                        f"required property {r!r} is not allowed (additionalProperties false)",
                        path + ("required",),
                    )
                props[r] = True
        self._check_property_counts(schema, props, required, additional, path)
        sub = name + "-" if name else ""
        self.structure_depth += 1
        try:
            if not props and (additional is True or additional == {}):
                return self.primitive("object")
            kv: dict[str, str] = {}
            for prop, prop_schema in props.items():
                value = self.visit(prop_schema, f"{sub}{prop}", path + ("properties", prop))
                kv[prop] = self.add_rule(
                    f"{sub}{prop}-kv", f'{gbnf_literal(_dump(prop))} space ":" space {value}'
                )
            required_props = [p for p in props if p in required]
            optional = [p for p in props if p not in required]
            if additional not in (None, False):
                if isinstance(additional, Mapping) and self._constraining(additional):
                    value = self.visit(
                        additional, f"{sub}additional-value", path + ("additionalProperties",)
                    )
                else:
                    value = self.primitive("value")
                key = self.add_rule(
                    f"{sub}additional-k", self._not_strings(list(props), path + ("properties",))
                )
                kv["*"] = self.add_rule(f"{sub}additional-kv", f'{key} ":" space {value}')
                optional.append("*")
        finally:
            self.structure_depth -= 1
        if not required_props and not optional:
            return '"{" space "}"'
        rule = '"{" space ' + ' "," space '.join(kv[p] for p in required_props)
        if optional:
            # llama.cpp's get_recursive_refs: any optional key may come first, the others
            # follow in schema order, each at most once ("*", extra keys, any number)
            rest: list[str] = [""] * (len(optional) + 1)
            for i in range(len(optional) - 1, 0, -1):
                k = optional[i]
                body = f'( "," space {kv[k]} )' + ("*" if k == "*" else "?")
                if rest[i + 1]:
                    body += " " + rest[i + 1]
                key = "additional" if k == "*" else _INVALID_NAME.sub("-", k)
                rest[i] = self.add_rule(f"{sub}{key}-rest", body)
            chains = []
            for i, k in enumerate(optional):
                chain = kv[k] + (f' ( "," space {kv[k]} )*' if k == "*" else "")
                if rest[i + 1]:
                    chain += " " + rest[i + 1]
                chains.append(chain)
            body = " | ".join(chains)
            rule += f' ( "," space ( {body} ) )?' if required_props else f" ( {body} )?"
        return rule + ' space "}"'

    def _not_strings(self, names: list[str], path: tuple) -> str:
        """A JSON string that is none of ``names``, as llama.cpp's _not_strings: a trie of
        the names whose every branch leaves it. Keys are written without escapes, so
        ``"\\u0061"`` cannot sneak in as ``"a"``."""
        key_char = self.primitive("key-char")
        if not names:
            return f'"\\"" {key_char}* "\\""'
        end = "\x00"  # marks the end of a name in the trie
        trie: dict = {}
        for word in names:
            if any(ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in word):
                raise self.error(
                    f"additionalProperties next to property name {word!r}, which needs "
                    "escaping, is not supported",
                    path,
                )
            node = trie
            for ch in word:
                node = node.setdefault(ch, {})
            node[end] = {}
        out: list[str] = []
        # an explicit stack of strings to write and trie nodes to expand, so a long
        # property name costs no recursion
        todo: list[Any] = [trie]
        while todo:
            item = todo.pop()
            if isinstance(item, str):
                out.append(item)
                continue
            keys = sorted(k for k in item if k != end)
            actions: list[Any] = []
            for i, ch in enumerate(keys):
                child = item[ch]
                actions.append((" | " if i else "") + f"[{_class_char(ch)}]")
                grandchildren = [k for k in child if k != end]
                if not grandchildren:
                    actions.append(f" {key_char}+")
                else:
                    actions += [" (", child, ")" if end in child else ")?"]
            rejects = "".join(_class_char(k) for k in keys)
            actions.append(f' | [^"\\\\\\x7F\\x00-\\x1F{rejects}] {key_char}*')
            todo.extend(reversed(actions))
        optional = "" if end in trie else "?"
        return f'"\\"" ( {"".join(out)} ){optional} "\\""'

    def _check_property_counts(self, schema, props, required, additional, path) -> None:
        if not self.strict:
            return
        lo = schema.get("minProperties")
        if lo is not None and lo > len(set(required)):
            raise self.error(
                f"minProperties {lo} above the {len(set(required))} required properties",
                path + ("minProperties",),
            )
        hi = schema.get("maxProperties")
        if hi is not None and (hi < len(set(required)) or additional not in (None, False)):
            if hi < len(props) or additional not in (None, False):
                raise self.error(
                    f"maxProperties {hi} cannot be enforced here", path + ("maxProperties",)
                )

    # -- arrays --------------------------------------------------------------------------------

    def _count(self, schema: Mapping, key: str, path: tuple, default: int | None) -> int | None:
        v = schema.get(key, default)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise self.error(f"{key} must be a non-negative integer, got {v!r}", path + (key,))
        if v > MAX_COUNT:
            raise self.error(f"{key} {v} is above the limit {MAX_COUNT}", path + (key,))
        return v

    def array_rule(self, schema: Mapping, name: str, path: tuple) -> str:
        sub = name + "-" if name else ""
        lo = self._count(schema, "minItems", path, 0)
        hi = self._count(schema, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise self.error(f"maxItems {hi} < minItems {lo}", path + ("maxItems",))
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        rest_key = "items"
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items, rest_key = items, schema.get("additionalItems"), "additionalItems"
        elif isinstance(prefix, Mapping) and items in (None, True, {}):
            items, prefix = prefix, None  # a schema, not a list: read as items, as llama.cpp
        self.structure_depth += 1
        try:
            if prefix is not None:
                return self._tuple_rule(prefix, items, rest_key, lo, hi, sub, path)
            if items is False:
                if lo > 0:
                    raise self.error("items is false but minItems > 0", path + ("items",))
                return '"[" space "]"'
            if (items is None or items is True or items == {}) and lo == 0 and hi is None:
                return self.primitive("array")
            item = self.visit(True if items is None else items, f"{sub}item", path + ("items",))
            return '"[" space ' + self._separated(item, lo, hi, sub) + ' space "]"'
        finally:
            self.structure_depth -= 1

    def _separated(self, item: str, lo: int, hi: int | None, sub: str) -> str:
        if hi == 0:
            return ""
        more = self.add_rule(f"{sub}item-more", f'"," space {item}')
        rest = repeat_gbnf(
            more,
            max(lo - 1, 0),
            None if hi is None else hi - 1,
            lambda body: self.add_rule(f"{sub}items", body),
        )
        seq = f"{item} {rest}".strip()
        return seq if lo > 0 else f"( {seq} )?"

    def _tuple_rule(self, prefix, rest, rest_key, lo, hi, sub, path) -> str:
        """All the tuple's items (as llama.cpp; at most maxItems of them), then more of
        ``rest`` only as minItems asks."""
        key = "prefixItems" if rest_key == "items" else "items"
        if not isinstance(prefix, list):
            raise self.error(f"{key} must be a list", path + (key,))
        n = len(prefix) if hi is None else min(len(prefix), hi)
        parts = [
            self.visit(s, f"{sub}tuple-{i}", path + (key, i)) for i, s in enumerate(prefix[:n])
        ]
        seq = ' "," space '.join(parts)
        extra = lo - n
        if extra > 0:
            if rest is False:
                raise self.error(f"minItems {lo} needs more than the {n} tuple items", path)
            item = self.visit(
                True if rest in (None, True) else rest, f"{sub}extra", path + (rest_key,)
            )
            if not seq:
                seq = item
                extra -= 1
            more = self.add_rule(f"{sub}extra-more", f'"," space {item}')
            reps = repeat_gbnf(more, extra, extra, lambda b: self.add_rule(f"{sub}extras", b))
            seq = f"{seq} {reps}".strip()
        return f'"[" space {seq} space "]"' if seq else '"[" space "]"'

    # -- strings -------------------------------------------------------------------------------

    def string_rule(self, schema: Mapping, rule_name: str, path: tuple) -> str:
        lo = self._count(schema, "minLength", path, 0)
        hi = self._count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            raise self.error(f"maxLength {hi} < minLength {lo}", path + ("maxLength",))
        has_length = lo > 0 or hi is not None
        if "pattern" in schema:
            if has_length and self.strict:
                raise self.error("pattern with minLength/maxLength is not supported", path)
            if "format" in schema and self.strict:
                raise self.error("pattern with format is not supported", path)
            try:
                expr = self.regex.compile(schema["pattern"], rule_name, search=True)
            except RegexError as err:
                raise self.error(f"unsupported pattern: {err}", path + ("pattern",)) from None
            return self.add_rule(rule_name, f'"\\"" {expr} "\\""')
        fmt = schema.get("format")
        if fmt is not None:
            prim = _FORMATS.get(fmt) if isinstance(fmt, str) else None
            if prim is None:
                if self.strict:
                    raise self.error(f"unsupported format {fmt!r}", path + ("format",))
            else:
                if has_length and self.strict:
                    raise self.error("format with minLength/maxLength is not supported", path)
                return self.add_rule(rule_name, self.primitive(prim))
        if has_length:
            char = self.primitive("char")
            reps = repeat_gbnf(char, lo, hi, lambda b: self.add_rule(f"{rule_name}-chars", b))
            return self.add_rule(rule_name, f'"\\"" {reps} "\\""')
        return self.add_rule(rule_name, self.primitive("string"))

    # -- numbers -------------------------------------------------------------------------------

    def _bounds(self, schema: Mapping, path: tuple) -> tuple:
        """(low, low exclusive, high, high exclusive) from draft 4 or draft 6+ keywords."""
        out = []
        for side, key, ex_key in (
            ("low", "minimum", "exclusiveMinimum"),
            ("high", "maximum", "exclusiveMaximum"),
        ):
            bound = schema.get(key)
            ex = schema.get(ex_key)
            exclusive = False
            if isinstance(ex, bool):
                exclusive = ex and bound is not None
            elif ex is not None:
                if not isinstance(ex, int | float) or not math.isfinite(ex):
                    raise self.error(f"{ex_key} must be a number", path + (ex_key,))
                if bound is None or (ex >= bound if side == "low" else ex <= bound):
                    bound, exclusive = ex, True
            if bound is not None and (
                isinstance(bound, bool)
                or not isinstance(bound, int | float)
                or not math.isfinite(bound)
            ):
                raise self.error(f"{key} must be a finite number", path + (key,))
            out += [bound, exclusive]
        return tuple(out)

    def _int_bounds(
        self, schema: Mapping, path: tuple, check: bool = True
    ) -> tuple[int | None, int | None]:
        low, low_ex, high, high_ex = self._bounds(schema, path)
        lo = hi = None
        if low is not None:
            lo = math.floor(low) + 1 if low_ex and float(low).is_integer() else math.ceil(low)
        if high is not None:
            hi = math.ceil(high) - 1 if high_ex and float(high).is_integer() else math.floor(high)
        if check and lo is not None and hi is not None and lo > hi:
            raise self.error(f"no integer between the bounds {low} and {high}", path)
        return lo, hi

    def integer_rule(self, schema: Mapping, path: tuple) -> str:
        lo, hi = self._int_bounds(schema, path)
        if lo is None and hi is None:
            return self.primitive("integer")
        return "(" + _integer_range(lo, hi) + ")"

    def number_rule(self, schema: Mapping, path: tuple) -> str:
        low, low_ex, high, high_ex = self._bounds(schema, path)
        if low is None and high is None:
            return self.primitive("number")
        alts = []
        lo, hi = self._int_bounds(schema, path, check=False)
        if lo is None or hi is None or lo <= hi:
            alts.append(_integer_range(lo, hi))
        frac = '"." [0]{0,15} [1-9] [0-9]{0,15}'  # not all zeros: strictly inside (n, n+1)
        # n.frac > 0: needs n >= low and n + 1 <= high
        p_lo = 0 if low is None else max(0, math.ceil(low))
        p_hi = None if high is None else math.floor(high) - 1
        if p_hi is None or p_lo <= p_hi:
            alts.append(f"({_natural_range(p_lo, p_hi)}) {frac}")
        # -m.frac in (-(m+1), -m): needs -(m+1) >= low and -m <= high
        m_lo = 0 if high is None else max(0, math.ceil(-high))
        m_hi = None if low is None else math.floor(-low) - 1
        if m_hi is None or m_lo <= m_hi:
            alts.append(f'"-" ({_natural_range(m_lo, m_hi)}) {frac}')
        if not alts:
            raise self.error(f"no number between the bounds {low} and {high}", path)
        return "(" + " | ".join(f"({a})" for a in alts) + ")"

    def format(self) -> str:
        lines = [f"root ::= {self.rules['root']}"] if "root" in self.rules else []
        lines += [f"{k} ::= {v}" for k, v in sorted(self.rules.items()) if k != "root"]
        return "\n".join(lines) + "\n"


def _class_char(ch: str) -> str:
    if ch in "\\]-^[":
        return "\\" + ch if ch != "^" else "\\x5E"
    if ch == '"':
        return '"'
    return ch


def schema_to_gbnf(schema: str | bytes | Mapping[str, Any] | bool, *, strict: bool = True) -> str:
    """The GBNF grammar (root ``root``) of a JSON schema (a dict, a bool, or JSON text).

    Raises ``SchemaError`` naming the path of what cannot be expressed."""
    if isinstance(schema, bytes | bytearray):
        try:
            schema = bytes(schema).decode("utf-8")
        except UnicodeDecodeError:
            raise SchemaError("schema text is not valid UTF-8") from None
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise SchemaError(f"schema has {len(schema)} characters, above {MAX_SCHEMA_CHARS}")
        if _text_depth(schema) > MAX_JSON_DEPTH:
            raise SchemaError(f"schema nested deeper than {MAX_JSON_DEPTH}")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as err:
            raise SchemaError(f"schema is not valid JSON: {err}") from None
    if not isinstance(schema, Mapping | bool):
        raise SchemaError(f"a schema must be an object or a boolean, got {type(schema).__name__}")
    _check_document(schema)
    conv = _Converter(schema, strict)
    try:
        root = conv.visit(schema, "", ())
    except RecursionError:  # pragma: no cover - depth limits come first
        raise SchemaError("schema nested too deeply") from None
    if root != "root":
        conv.rules["root"] = root
    return conv.format()
