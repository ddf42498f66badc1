"""RELIABILITY.md items 27-32: hostile grammars and schemas give a clear error (or a
bounded grammar), never a hang, a crash or unbounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from picollama.sampling import gbnf
from picollama.sampling.grammar import Grammar, GrammarError, TokenConstraint
from picollama.sampling.json_schema import SchemaError, schema_to_gbnf
from picollama.sampling.samplers import Sampler, SamplingParams


def _fast(fn, limit_s: float = 5.0):
    t0 = time.perf_counter()
    out = fn()
    assert time.perf_counter() - t0 < limit_s
    return out


# 27 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,what,line,col",
    [
        ('root ::= "abc\n', "unterminated literal", 1, 10),
        ('root ::= [a-z\nx ::= "y"', "unterminated character class", 1, 10),
        ('root ::= item\nitem ::= thing "x"', "undefined rule 'thing'", 2, 10),
        ('main ::= "a"', "no rule named 'root'", 1, 1),
    ],
)
def test_27_syntax_errors_name_the_position(text, what, line, col):
    with pytest.raises(GrammarError) as err:
        Grammar.parse(text)
    assert what in str(err.value)
    assert (err.value.line, err.value.column) == (line, col)


# 28 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        'root ::= root "a" | "b"',
        'root ::= x "a"\nx ::= root "b" | "c"',
        'root ::= e root "a" | "b"\ne ::= "x" | ',  # through an empty alternative
        'root ::= e root "a" | "b"\ne ::= "x"?',  # through a rule that may be empty
        'root ::= ("a"? | "")* root "z" | "y"',
    ],
)
def test_28_left_recursion_is_refused_fast(text):
    with pytest.raises(GrammarError, match="left recursion"):
        _fast(lambda: Grammar.parse(text))


# 29 --------------------------------------------------------------------------------------------


def test_29_deep_parentheses_are_refused_without_recursion():
    text = "root ::= " + "(" * 60000 + '"a"' + ")" * 60000
    with pytest.raises(GrammarError, match="nested deeper"):
        _fast(lambda: Grammar.parse(text))
    ok = "root ::= " + "(" * gbnf.MAX_NESTING + '"a"' + ")" * gbnf.MAX_NESTING
    assert _fast(lambda: Grammar.parse(ok)).accepts("a")


def test_29_long_rule_chains():
    chain = "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(5000)) + 'r5000 ::= "y"\n'
    with pytest.raises(GrammarError, match="defines more than"):
        _fast(lambda: Grammar.parse("root ::= r0\n" + chain))
    # a chain within the limit works, though each stack is thousands of positions deep
    n = 1500
    chain = "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(n)) + f'r{n} ::= "y"\n'
    g = _fast(lambda: Grammar.parse("root ::= r0\n" + chain))
    assert _fast(lambda: g.accepts("y" + "x" * n))


def test_29_text_size_is_capped():
    with pytest.raises(GrammarError, match="characters"):
        Grammar.parse('root ::= "' + "a" * (gbnf.MAX_GRAMMAR_CHARS + 1) + '"')


# 30 --------------------------------------------------------------------------------------------


def test_30_nested_stars_are_bounded():
    g = _fast(lambda: Grammar.parse('root ::= ("a"*)*'))
    assert _fast(lambda: g.accepts("a" * 500))
    g = _fast(lambda: Grammar.parse('root ::= (("a"*)* ("b"?)*)* "c"'))
    assert g.accepts("aababbc")


@pytest.mark.parametrize(
    "text,message",
    [
        ('root ::= "a"{5,0}', "below lower bound"),
        ('root ::= "a"{1000000000}', "exceeds the limit"),
        ('root ::= "a"{5000,}', "exceeds the limit"),
        ('root ::= ("a"{0,50}){0,50}', "above the limit"),
        ('root ::= "a"{99999999999999999999999999999999999999}', "integer too large"),
        ('root ::= "' + "a" * 2000 + '"{2000}', "elements"),
    ],
)
def test_30_repetitions_beyond_the_limits_are_refused(text, message):
    with pytest.raises(GrammarError, match=message):
        _fast(lambda: Grammar.parse(text))


def test_30_huge_upper_bound_is_bounded_like_llama_cpp():
    # llama.cpp reads an upper bound above its limit (2000) as "no upper bound"
    g = _fast(lambda: Grammar.parse('root ::= "a"{0,1000000000}'))
    assert len(g.rules) == 2
    assert g.accepts("a" * 3000)


def test_30_ambiguous_grammar_hits_the_stack_limit_not_the_memory():
    # every prefix of a's can be split in exponentially many ways; stacks stay a set
    g = Grammar.parse('root ::= x*\nx ::= "a" | "aa" | "aaa" | "a" x')
    assert _fast(lambda: g.accepts("a" * 300))


# 31 --------------------------------------------------------------------------------------------


def test_31_completed_grammar_gives_end_of_generation():
    pieces = [b"a", b"b", b"ab", b""]
    eog = 3
    c = TokenConstraint(Grammar.parse('root ::= "ab"'), pieces, [eog])
    s = Sampler(SamplingParams(seed=1), 4, grammar=c)
    out = []
    for _ in range(6):  # asked for more than the grammar allows
        logits = np.array([5.0, 5.0, 0.0, -5.0], dtype=np.float32)
        tok = s.sample(logits)
        s.accept(tok)
        out.append(tok)
    assert out[:2] == [0, 1] and set(out[2:]) == {eog}


# 32 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema,path",
    [
        ({"$ref": "#"}, "$"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            "$",
        ),
        (
            {"properties": {"p": {"type": "string", "pattern": "^(a)\\1$"}}},
            "$.properties.p.pattern",
        ),
        ({"properties": {"p": {"type": "string", "pattern": "(?=x)"}}}, "$.properties.p.pattern"),
        ({"type": "array", "items": {"type": "kaboom"}}, "$.items.type"),
        ({"$ref": "https://example.com/schema.json"}, "$"),
        ({"$ref": "#/$defs/missing"}, "$"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "$"),
    ],
)
def test_32_schema_errors_name_the_path(schema, path):
    with pytest.raises(SchemaError) as err:
        _fast(lambda: schema_to_gbnf(schema))
    assert err.value.path.startswith(path), err.value.path
    assert str(err.value).startswith(err.value.path)


def test_32_recursive_ref_through_an_object_is_fine():
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["kids"],
            }
        },
        "$ref": "#/$defs/node",
    }
    g = Grammar.parse(schema_to_gbnf(schema))
    assert g.accepts('{"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}')


def test_32_empty_properties_and_long_max_length():
    g = Grammar.parse(schema_to_gbnf({"type": "object", "properties": {}}))
    assert g.accepts("{}") and g.accepts('{"any": 1}')
    g = Grammar.parse(
        schema_to_gbnf({"type": "object", "properties": {}, "additionalProperties": False})
    )
    assert g.accepts("{ }") and not g.accepts('{"a": 1}')
    text = _fast(lambda: schema_to_gbnf({"type": "string", "maxLength": 65536}))
    assert len(text) < 20000
    g = _fast(lambda: Grammar.parse(text))
    assert len(g.rules) < 5000
    assert g.accepts(json.dumps("x" * 3000))
    # above the GBNF repetition limit the count stays exact (chunked repetitions)
    g = Grammar.parse(schema_to_gbnf({"type": "string", "minLength": 2001, "maxLength": 2503}))
    for n, ok in [(2000, False), (2001, True), (2503, True), (2504, False)]:
        assert g.accepts(json.dumps("é" * n, ensure_ascii=False)) == ok, n


def test_32_deep_schema_is_refused_without_recursion_error():
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaError, match="nested deeper"):
        schema_to_gbnf(deep)
    with pytest.raises(SchemaError, match="nested deeper"):
        schema_to_gbnf('{"items": ' * 30000 + "{}" + "}" * 30000)


def test_hostile_inputs_under_a_memory_cap():
    """The worst of the above in a child process with 2 GiB of address space and a
    time limit: it must finish with errors, not be killed."""
    code = textwrap.dedent(
        """
        import resource, json
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from picollama.sampling.grammar import Grammar, GrammarError
        from picollama.sampling.json_schema import schema_to_gbnf, SchemaError
        bad = [
            'root ::= "a"{5,0}', 'root ::= ' + '(' * 60000 + '"a"' + ')' * 60000,
            'root ::= ("a"{0,50}){0,50}', 'root ::= root "a" | "b"',
        ]
        for text in bad:
            try:
                Grammar.parse(text)
                raise SystemExit("accepted: " + text[:40])
            except GrammarError:
                pass
        g = Grammar.parse('root ::= ("a"*)*')
        assert g.accepts("a" * 2000)
        schemas = ['{"$ref": "#"}', "[" * 200000, '{"type": "string", "maxLength": 10**9}']
        for schema in schemas:
            try:
                Grammar.parse(schema_to_gbnf(schema))
            except GrammarError:
                pass
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
