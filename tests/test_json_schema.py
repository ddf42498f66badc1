# ruff: noqa: E501  (ported test data: schemas kept on one line)
"""JSON schema to GBNF: every output the grammar lets a sampler produce must validate.

Schemas come from llama.cpp's tests/test-json-schema-to-grammar.cpp (llama-cpp-python 0.3.36
source distribution) and from the features list of the issue; outputs are drawn by random
constrained sampling (``random_generate``) and checked with ``json.loads`` and the
``jsonschema`` package, formats included.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import uuid

import pytest
from test_grammar_sampling import random_generate

from picollama.sampling.grammar import Grammar, LlamaGrammar
from picollama.sampling.json_schema import SchemaError, schema_to_gbnf

jsonschema = pytest.importorskip("jsonschema")

LLAMA_SCHEMAS = [
    (True, "min 0", '{"type": "integer", "minimum": 0}'),
    (True, "min 1", '{"type": "integer", "minimum": 1}'),
    (True, "min 3", '{"type": "integer", "minimum": 3}'),
    (True, "min 9", '{"type": "integer", "minimum": 9}'),
    (True, "min 10", '{"type": "integer", "minimum": 10}'),
    (True, "min 25", '{"type": "integer", "minimum": 25}'),
    (True, "max 30", '{"type": "integer", "maximum": 30}'),
    (True, "min -5", '{"type": "integer", "minimum": -5}'),
    (True, "min -123", '{"type": "integer", "minimum": -123}'),
    (True, "max -5", '{"type": "integer", "maximum": -5}'),
    (True, "max 1", '{"type": "integer", "maximum": 1}'),
    (True, "max 100", '{"type": "integer", "maximum": 100}'),
    (True, "min 0 max 23", '{"type": "integer", "minimum": 0, "maximum": 23}'),
    (True, "min 15 max 300", '{"type": "integer", "minimum": 15, "maximum": 300}'),
    (True, "min 5 max 30", '{"type": "integer", "minimum": 5, "maximum": 30}'),
    (True, "min -123 max 42", '{"type": "integer", "minimum": -123, "maximum": 42}'),
    (True, "min -10 max 10", '{"type": "integer", "minimum": -10, "maximum": 10}'),
    (False, "unknown type", '{"type": "kaboom"}'),
    (False, "invalid type", '{"type": 123}'),
    (True, "empty schema (any value)", "{}"),
    (
        True,
        "exotic formats",
        '{"items": [{"format": "date"}, {"format": "uuid"}, {"format": "time"}, {"format": "date-time"}]}',
    ),
    (True, "string", '{"type": "string"}'),
    (True, "string w/ min length 1", '{"type": "string", "minLength": 1}'),
    (True, "string w/ min length 3", '{"type": "string", "minLength": 3}'),
    (True, "string w/ max length", '{"type": "string", "maxLength": 3}'),
    (True, "string w/ min & max length", '{"type": "string", "minLength": 1, "maxLength": 4}'),
    (True, "boolean", '{"type": "boolean"}'),
    (True, "integer", '{"type": "integer"}'),
    (True, "string const", '{"const": "foo"}'),
    (True, "non-string const", '{"const": 123}'),
    (True, "non-string enum", '{"enum": ["red", "amber", "green", null, 42, ["foo"]]}'),
    (True, "string array", '{"type": "array", "prefixItems": {"type": "string"}}'),
    (
        True,
        "nullable string array",
        '{"type": ["array", "null"], "prefixItems": {"type": "string"}}',
    ),
    (True, "tuple1", '{"prefixItems": [{"type": "string"}]}'),
    (True, "tuple2", '{"prefixItems": [{"type": "string"}, {"type": "number"}]}'),
    (True, "array with empty items", '{"type": "array", "items": {}}'),
    (
        True,
        "array with empty items and prefixItems",
        '{"type": "array", "items": {}, "prefixItems": {"type": "string"}}',
    ),
    (True, "number", '{"type": "number"}'),
    (True, "minItems", '{"items": {"type": "boolean"}, "minItems": 2}'),
    (True, "maxItems 0", '{"items": {"type": "boolean"}, "maxItems": 0}'),
    (True, "maxItems 1", '{"items": {"type": "boolean"}, "maxItems": 1}'),
    (True, "maxItems 2", '{"items": {"type": "boolean"}, "maxItems": 2}'),
    (
        True,
        "min + maxItems",
        '{"items": {"type": ["number", "integer"]}, "minItems": 3, "maxItems": 5}',
    ),
    (
        True,
        "min + max items with min + max values across zero",
        '{"items": {"type": "integer", "minimum": -12, "maximum": 207}, "minItems": 3, "maxItems": 5}',
    ),
    (
        True,
        "min + max items with min + max values",
        '{"items": {"type": "integer", "minimum": 12, "maximum": 207}, "minItems": 3, "maxItems": 5}',
    ),
    (True, "simple regexp", '{"type": "string", "pattern": "^abc?d*efg+(hij)?kl$"}'),
    (
        True,
        "regexp escapes",
        '{"type": "string", "pattern": "^\\\\[\\\\]\\\\{\\\\}\\\\(\\\\)\\\\|\\\\+\\\\*\\\\?$"}',
    ),
    (True, "regexp quote", '{"type": "string", "pattern": "^\\"$"}'),
    (True, "regexp with top-level alternation", '{"type": "string", "pattern": "^A|B|C|D$"}'),
    (
        True,
        "regexp",
        '{"type": "string", "pattern": "^(\\\\([0-9]{1,3}\\\\))?[0-9]{3}-[0-9]{4} a{3,5}nd...$"}',
    ),
    (
        True,
        "required props in original order",
        '{"type": "object", "properties": {"b": {"type": "string"}, "c": {"type": "string"}, "a": {"type": "string"}}, "required": ["a", "b", "c"], "additionalProperties": false, "definitions": {}}',
    ),
    (
        True,
        "1 optional prop",
        '{"properties": {"a": {"type": "string"}}, "additionalProperties": false}',
    ),
    (
        True,
        "N optional props",
        '{"properties": {"a": {"type": "string"}, "b": {"type": "string"}, "c": {"type": "string"}}, "additionalProperties": false}',
    ),
    (
        True,
        "required + optional props each in original order",
        '{"properties": {"b": {"type": "string"}, "a": {"type": "string"}, "d": {"type": "string"}, "c": {"type": "string"}}, "required": ["a", "b"], "additionalProperties": false}',
    ),
    (
        True,
        "additional props",
        '{"type": "object", "additionalProperties": {"type": "array", "items": {"type": "number"}}}',
    ),
    (True, "additional props (true)", '{"type": "object", "additionalProperties": true}'),
    (True, "additional props (implicit)", '{"type": "object"}'),
    (True, "empty w/o additional props", '{"type": "object", "additionalProperties": false}'),
    (
        True,
        "required + additional props",
        '{"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"], "additionalProperties": {"type": "string"}}',
    ),
    (
        True,
        "optional + additional props",
        '{"type": "object", "properties": {"a": {"type": "number"}}, "additionalProperties": {"type": "number"}}',
    ),
    (
        True,
        "required + optional + additional props",
        '{"type": "object", "properties": {"and": {"type": "number"}, "also": {"type": "number"}}, "required": ["and"], "additionalProperties": {"type": "number"}}',
    ),
    (
        True,
        "optional props with empty name",
        '{"properties": {"": {"type": "integer"}, "a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}}',
    ),
    (
        True,
        "optional props with nested names",
        '{"properties": {"a": {"type": "integer"}, "aa": {"type": "integer"}}, "additionalProperties": {"type": "integer"}}',
    ),
    (
        True,
        "optional props with common prefix",
        '{"properties": {"ab": {"type": "integer"}, "ac": {"type": "integer"}}, "additionalProperties": {"type": "integer"}}',
    ),
    (
        True,
        "top-level $ref",
        '{"$ref": "#/definitions/foo", "definitions": {"foo": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": false}}}',
    ),
    (
        True,
        "anyOf",
        '{"anyOf": [{"$ref": "#/definitions/foo"}, {"$ref": "#/definitions/bar"}], "definitions": {"foo": {"properties": {"a": {"type": "number"}}}, "bar": {"properties": {"b": {"type": "number"}}}}, "type": "object"}',
    ),
    (
        True,
        "anyOf $ref",
        '{"properties": {"a": {"anyOf": [{"type": "string"}, {"type": "number"}]}, "b": {"anyOf": [{"$ref": "#/properties/a/anyOf/0"}, {"type": "boolean"}]}}, "type": "object"}',
    ),
    (
        True,
        "mix of allOf, anyOf and $ref (similar to https://json.schemastore.org/tsconfig.json)",
        '{"allOf": [{"$ref": "#/definitions/foo"}, {"$ref": "#/definitions/bar"}, {"anyOf": [{"$ref": "#/definitions/baz"}, {"$ref": "#/definitions/bam"}]}], "definitions": {"foo": {"properties": {"a": {"type": "number"}}}, "bar": {"properties": {"b": {"type": "number"}}}, "bam": {"properties": {"c": {"type": "number"}}}, "baz": {"properties": {"d": {"type": "number"}}}}, "type": "object"}',
    ),
    (
        True,
        "allOf with enum schema",
        '{"allOf": [{"$ref": "#/definitions/foo"}], "definitions": {"foo": {"type": "string", "enum": ["a", "b"]}}}',
    ),
    (
        True,
        "allOf with multiple enum schemas",
        '{"allOf": [{"$ref": "#/definitions/foo"}, {"$ref": "#/definitions/bar"}], "definitions": {"foo": {"type": "string", "enum": ["a", "b", "c"]}, "bar": {"type": "string", "enum": ["b", "c", "d"]}}}',
    ),
    (
        True,
        "conflicting names",
        '{"type": "object", "properties": {"number": {"type": "object", "properties": {"number": {"type": "object", "properties": {"root": {"type": "number"}}, "required": ["root"], "additionalProperties": false}}, "required": ["number"], "additionalProperties": false}}, "required": ["number"], "additionalProperties": false, "definitions": {}}',
    ),
    (
        True,
        "description only (no type) treated as unconstrained",
        '{"description": "The 0-based index of the last line to be retrieved (inclusive). If None, read until the end of the file."}',
    ),
    (
        True,
        "literal string with escapes",
        '{"properties": {"code": {"const": " \\r \\n \\" \\\\ ", "description": "Generated code", "title": "Code", "type": "string"}}, "required": ["code"], "title": "DecoderResponse", "type": "object"}',
    ),
    (True, "regexp with non-capturing group", '{"type": "string", "pattern": "^(?:foo|bar)baz$"}'),
    (
        True,
        "regexp with nested non-capturing groups",
        '{"type": "string", "pattern": "^(?:(?:ab)+c)?d$"}',
    ),
    (True, "unanchored regexp", '{"type": "string", "pattern": "[0-9]+"}'),
    (True, "regexp with unsupported shorthand", '{"type": "string", "pattern": "^[0-9]{3}\\\\w$"}'),
    (
        True,
        "regexp with escaped hyphen in a character class",
        '{"type": "string", "pattern": "^[a-z\\\\-]+$"}',
    ),
    (
        True,
        "regexp with escaped hyphen outside a character class",
        '{"type": "string", "pattern": "^a\\\\-b$"}',
    ),
    (False, "regexp with unbalanced parentheses", '{"type": "string", "pattern": "^(a$"}'),
    (
        True,
        "unsupported regexp in a property",
        '{"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)a$"}}, "required": ["a"], "additionalProperties": false}',
    ),
]

# cases where our converter refuses what llama.cpp degrades to "any string"
REFUSED = {"unsupported regexp in a property"}
# schemas that break the JSON schema meta-schema (prefixItems must be a list)
NOT_VALIDATABLE = {
    "string array",
    "nullable string array",
    "array with empty items and prefixItems",
}


def _format_checker():
    checker = jsonschema.FormatChecker()

    @checker.checks("date", raises=ValueError)
    def _date(s):
        return not isinstance(s, str) or bool(datetime.date.fromisoformat(s))

    @checker.checks("time", raises=ValueError)
    def _time(s):
        return not isinstance(s, str) or datetime.time.fromisoformat(s).tzinfo is not None

    @checker.checks("date-time", raises=ValueError)
    def _date_time(s):
        return not isinstance(s, str) or bool(datetime.datetime.fromisoformat(s))

    @checker.checks("uuid", raises=ValueError)
    def _uuid(s):
        return not isinstance(s, str) or bool(uuid.UUID(s))

    @checker.checks("email")
    def _email(s):
        return not isinstance(s, str) or re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", s) is not None

    return checker


CHECKER = _format_checker()


def validate(doc, schema):
    text = json.dumps(schema)
    cls = jsonschema.Draft202012Validator
    if "prefixItems" not in text and isinstance(schema.get("items"), list):
        cls = jsonschema.Draft7Validator
    cls(schema, format_checker=CHECKER).validate(doc)


def check_generation(schema, seeds, strict=True):
    grammar = schema_to_gbnf(schema, strict=strict)
    for seed in seeds:
        text = random_generate(grammar, seed)
        doc = json.loads(text)
        validate(doc, schema)


@pytest.mark.parametrize("ok,name,text", LLAMA_SCHEMAS, ids=[c[1] for c in LLAMA_SCHEMAS])
def test_llama_cpp_schemas(ok, name, text):
    schema = json.loads(text)
    if not ok or name in REFUSED:
        with pytest.raises(SchemaError):
            schema_to_gbnf(schema)
        return
    grammar = schema_to_gbnf(schema)
    assert Grammar.parse(grammar)
    for seed in range(2):
        doc = json.loads(random_generate(grammar, seed))
        if name not in NOT_VALIDATABLE:
            validate(doc, schema)


# -- features ---------------------------------------------------------------------------------

NESTED = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "minLength": 1, "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                "kind": {"enum": ["home", "work", None, 3]},
            },
            "required": ["street", "zip"],
        }
    },
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -40, "maximum": 1234},
        "name": {"type": "string", "maxLength": 12},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/address"},
        "others": {"type": "array", "items": {"$ref": "#/$defs/address"}, "maxItems": 2},
        "when": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "time"},
        "uid": {"type": "string", "format": "uuid"},
        "mail": {"type": "string", "format": "email"},
        "ip": {"type": "string", "format": "ipv4"},
        "flag": {"type": ["boolean", "null"]},
        "pair": {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"const": "x"}],
            "minItems": 3,
        },
        "extra": {"type": "object", "additionalProperties": {"type": "integer", "maximum": 9}},
        "choice": {
            "anyOf": [{"type": "integer", "minimum": 100}, {"type": "string", "maxLength": 2}]
        },
        "both": {
            "allOf": [
                {"type": "object", "properties": {"p": {"const": 1}}, "required": ["p"]},
                {"properties": {"q": {"type": "boolean"}}, "required": ["q"]},
            ]
        },
    },
    "required": ["id", "name", "tags", "home", "when", "uid"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(8))
def test_nested_schema_generation_validates(seed):
    check_generation(NESTED, [seed])


def test_recursive_schema_generation_validates():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    }
    check_generation(tree, range(4))


def _accepts(schema, text, strict=True):
    return Grammar.parse(schema_to_gbnf(schema, strict=strict)).accepts(text)


@pytest.mark.parametrize("seed", range(20))
def test_integer_bounds_are_exact(seed):
    rng = random.Random(seed)
    lo = rng.choice([None, rng.randint(-2000, 2000), rng.randint(-10, 10)])
    hi = rng.choice([None, rng.randint(-2000, 3000)])
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    schema = {"type": "integer"}
    if lo is not None:
        schema["exclusiveMinimum" if seed % 3 == 0 else "minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    try:
        g = Grammar.parse(schema_to_gbnf(schema))
    except SchemaError:
        assert lo is not None and hi is not None and lo >= hi
        return
    low = None if lo is None else (lo + 1 if seed % 3 == 0 else lo)
    for x in range(-3100, 3100, 7) if seed % 2 else range(-60, 60):
        want = (low is None or x >= low) and (hi is None or x <= hi)
        assert g.accepts(str(x)) == want, (schema, x)
    assert not g.accepts("01")
    assert not g.accepts("-0") or (lo is None and hi is None)


def test_number_bounds_keep_inside():
    g = Grammar.parse(schema_to_gbnf({"type": "number", "exclusiveMinimum": -1.5, "maximum": 2}))
    for text, ok in [
        ("-1", True),
        ("-1.4", False),
        ("-0.5", True),
        ("0", True),
        ("1.99", True),
        ("2", True),
        ("2.0", False),
        ("2.5", False),
        ("-2", False),
        ("1e1", False),
        ("0.000", False),
        ("0.001", True),
    ]:
        assert g.accepts(text) == ok, text
    rng = random.Random(0)
    for _ in range(300):
        x = round(rng.uniform(-3, 3), rng.randint(0, 3))
        text = repr(x) if x != int(x) else str(int(x))
        if g.accepts(text):
            assert -1.5 < float(text) <= 2, text


def test_pattern_uses_search_semantics_and_json_escapes():
    schema = {"type": "string", "pattern": 'a\\d"|^x$'}
    g = Grammar.parse(schema_to_gbnf(schema))
    rx = re.compile(schema["pattern"])
    for value in ['a1"', 'za9"q', "x", "xx", 'a"', "", '\\a5"']:
        assert g.accepts(json.dumps(value)) == bool(rx.search(value)), value


def test_string_lengths_count_characters():
    g = Grammar.parse(schema_to_gbnf({"type": "string", "minLength": 2, "maxLength": 3}))
    for value, ok in [
        ("é", False),
        ("éé", True),
        ("a\nb", True),
        ("\\\\\\\\", False),
        ("abcd", False),
    ]:
        assert g.accepts(json.dumps(value, ensure_ascii=False)) == ok, value
    assert g.accepts('"\\u00e9\\u00e9"')


def test_properties_order_required_and_additional():
    schema = {
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "ab": {"const": 1}},
        "required": ["b"],
        "additionalProperties": {"type": "boolean"},
    }
    g = Grammar.parse(schema_to_gbnf(schema))
    assert g.accepts('{"b": "x"}')
    assert g.accepts('{"b": "x", "a": 1, "ab": 1, "zz": true, "a2": false}')
    assert not g.accepts('{"a": 1}')  # b is required
    assert not g.accepts('{"b": "x", "a": "no"}')
    assert not g.accepts('{"b": "x", "zz": 1}')  # extra keys take booleans
    assert not g.accepts('{"b": "x", "a": true}')  # a declared key can't be an extra one
    assert not g.accepts('{"b": "x", "\\u0061": true}')  # nor sneak in escaped


def test_default_object_is_closed_like_llama_cpp():
    schema = {"properties": {"a": {"type": "integer"}}}
    assert _accepts(schema, '{"a": 1}') and not _accepts(schema, '{"a": 1, "b": 2}')


def test_any_of_with_sibling_keywords_is_merged():
    schema = {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "required": ["kind"],
        "anyOf": [
            {"properties": {"n": {"type": "integer"}}, "required": ["n"]},
            {"properties": {"s": {"type": "string"}}, "required": ["s"]},
        ],
    }
    g = Grammar.parse(schema_to_gbnf(schema))
    assert g.accepts('{"kind": "a", "n": 1}') and g.accepts('{"kind": "b", "s": "x"}')
    assert not g.accepts('{"kind": "a"}')


@pytest.mark.parametrize(
    "schema,path",
    [
        ({"type": "array", "uniqueItems": True}, "$.uniqueItems"),
        ({"properties": {"x": {"type": "integer", "multipleOf": 3}}}, "$.properties.x.multipleOf"),
        (
            {"properties": {"items": {"type": "string", "pattern": "(?<=a)b"}}},
            "$.properties.items.pattern",
        ),
        ({"not": {"type": "string"}}, "$.not"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "$.if"),
        ({"type": "string", "format": "uri"}, "$.format"),
        ({"enum": []}, "$.enum"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "$.maxLength"),
        ({"type": "array", "minItems": -1}, "$.minItems"),
        ({"type": ["string", "kaboom"]}, "$.type"),
        ({"anyOf": [{"type": "string"}, False]}, "$.anyOf[1]"),
        (
            {"properties": {"a b": {"type": "object", "patternProperties": {}}}},
            '$.properties["a b"].patternProperties',
        ),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "$.allOf"),
        ({"const": float("nan")}, "$.const"),
    ],
)
def test_unsupported_is_an_error_naming_the_path(schema, path):
    with pytest.raises(SchemaError) as err:
        schema_to_gbnf(schema)
    assert err.value.path == path, str(err.value)


def test_lenient_mode_ignores_what_llama_cpp_ignores():
    schema = {"type": "array", "items": {"type": "integer", "multipleOf": 2}, "uniqueItems": True}
    g = Grammar.parse(schema_to_gbnf(schema, strict=False))
    assert g.accepts("[1, 1]")
    with pytest.raises(SchemaError):  # a pattern never degrades to any string
        schema_to_gbnf({"type": "string", "pattern": "(?=x)"}, strict=False)


def test_schema_text_and_llama_grammar():
    g = LlamaGrammar.from_json_schema(
        '{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}'
    )
    assert Grammar.parse(g.grammar).accepts('{"a":1}')
    with pytest.raises(SchemaError, match="not valid JSON"):
        schema_to_gbnf("{not json")
    assert Grammar.parse(schema_to_gbnf(True)).accepts("[1, {}]")
    with pytest.raises(SchemaError, match="false"):
        schema_to_gbnf(False)
