# ruff: noqa: E501  (ported test data: long grammar and schema literals kept on one line)
"""llama.cpp's grammar tests, ported: test-grammar-parser.cpp and test-grammar-integration.cpp.

The cases come from the llama.cpp sources inside the llama-cpp-python 0.3.36 source
distribution (vendor/llama.cpp/tests). Parser cases compare the rules and symbol ids with
llama.cpp's (our parser builds the same representation); integration cases feed each string
as llama.cpp's test harness does (one code point at a time as token 0, ``T(id)`` as the
token ``id`` whose text is ``<[id]>``) and check that passing strings end in an accepting
state and failing ones do not. Schema cases go through our ``schema_to_gbnf``.
"""

from __future__ import annotations

import json

import pytest

from picollama.sampling.gbnf import GType
from picollama.sampling.grammar import Grammar, GrammarError
from picollama.sampling.json_schema import schema_to_gbnf

END, ALT, RULE_REF, CHAR, CHAR_NOT = (
    GType.END,
    GType.ALT,
    GType.RULE_REF,
    GType.CHAR,
    GType.CHAR_NOT,
)
CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY = GType.CHAR_RNG_UPPER, GType.CHAR_ALT, GType.CHAR_ANY
TOKEN, TOKEN_NOT = GType.TOKEN, GType.TOKEN_NOT


class T(int):
    """A token id in a test input (llama.cpp's ``token(id)``)."""


# -- test-grammar-parser.cpp ------------------------------------------------------------------

FAILURES = [
    '\n        root ::= "a"{,}"\n    ',
    "\n        root ::= (((((([^x]*){0,99}){0,99}){0,99}){0,99}){0,99}){0,99}\n    ",
    '\n        root ::= "a"{,10}"\n    ',
    '\n        root ::= "a"{5000}\n    ',
    '\n        root ::= "a"{5000,}\n    ',
    '\n        root ::= "a"{5000,6000}\n    ',
]

PARSING = [
    (
        '\n        root ::= "a"{0,5000}\n    ',
        [("root", 0), ("root_1", 1)],
        [
            (RULE_REF, 1),
            (END, 0),
            (CHAR, 97),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root ::= "a"{3,5000}\n    ',
        [("root", 0), ("root_1", 1)],
        [
            (CHAR, 97),
            (CHAR, 97),
            (CHAR, 97),
            (RULE_REF, 1),
            (END, 0),
            (CHAR, 97),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"\n    ',
        [("root", 0)],
        [
            (CHAR, 97),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a" | [bdx-z] | [^1-3]\n    ',
        [("root", 0)],
        [
            (CHAR, 97),
            (ALT, 0),
            (CHAR, 98),
            (CHAR_ALT, 100),
            (CHAR_ALT, 120),
            (CHAR_RNG_UPPER, 122),
            (ALT, 0),
            (CHAR_NOT, 49),
            (CHAR_RNG_UPPER, 51),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= a+\n        a     ::= "a"\n    ',
        [("a", 1), ("root", 0), ("root_2", 2)],
        [
            (RULE_REF, 1),
            (RULE_REF, 2),
            (END, 0),
            (CHAR, 97),
            (END, 0),
            (RULE_REF, 1),
            (RULE_REF, 2),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"+\n    ',
        [("root", 0), ("root_1", 1)],
        [
            (CHAR, 97),
            (RULE_REF, 1),
            (END, 0),
            (CHAR, 97),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= a?\n        a     ::= "a"\n    ',
        [("a", 1), ("root", 0), ("root_2", 2)],
        [
            (RULE_REF, 2),
            (END, 0),
            (CHAR, 97),
            (END, 0),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"?\n    ',
        [("root", 0), ("root_1", 1)],
        [
            (RULE_REF, 1),
            (END, 0),
            (CHAR, 97),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= a*\n        a     ::= "a"\n    ',
        [("a", 1), ("root", 0), ("root_2", 2)],
        [
            (RULE_REF, 2),
            (END, 0),
            (CHAR, 97),
            (END, 0),
            (RULE_REF, 1),
            (RULE_REF, 2),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"*\n    ',
        [("root", 0), ("root_1", 1)],
        [
            (RULE_REF, 1),
            (END, 0),
            (CHAR, 97),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"{2}\n    ',
        [("root", 0)],
        [
            (CHAR, 97),
            (CHAR, 97),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"{2,}\n    ',
        [("root", 0), ("root_1", 1)],
        [
            (CHAR, 97),
            (CHAR, 97),
            (RULE_REF, 1),
            (END, 0),
            (CHAR, 97),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"{ 4}\n    ',
        [("root", 0)],
        [
            (CHAR, 97),
            (CHAR, 97),
            (CHAR, 97),
            (CHAR, 97),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= "a"{2,4}\n    ',
        [("root", 0), ("root_1", 1), ("root_2", 2)],
        [
            (CHAR, 97),
            (CHAR, 97),
            (RULE_REF, 2),
            (END, 0),
            (CHAR, 97),
            (ALT, 0),
            (END, 0),
            (CHAR, 97),
            (RULE_REF, 1),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= (expr "=" term "\\n")+\n        expr  ::= term ([-+*/] term)*\n        term  ::= [0-9]+\n    ',
        [
            ("expr", 2),
            ("expr_5", 5),
            ("expr_6", 6),
            ("root", 0),
            ("root_1", 1),
            ("root_4", 4),
            ("term", 3),
            ("term_7", 7),
        ],
        [
            (RULE_REF, 1),
            (RULE_REF, 4),
            (END, 0),
            (RULE_REF, 2),
            (CHAR, 61),
            (RULE_REF, 3),
            (CHAR, 10),
            (END, 0),
            (RULE_REF, 3),
            (RULE_REF, 6),
            (END, 0),
            (CHAR, 48),
            (CHAR_RNG_UPPER, 57),
            (RULE_REF, 7),
            (END, 0),
            (RULE_REF, 1),
            (RULE_REF, 4),
            (ALT, 0),
            (END, 0),
            (CHAR, 45),
            (CHAR_ALT, 43),
            (CHAR_ALT, 42),
            (CHAR_ALT, 47),
            (RULE_REF, 3),
            (END, 0),
            (RULE_REF, 5),
            (RULE_REF, 6),
            (ALT, 0),
            (END, 0),
            (CHAR, 48),
            (CHAR_RNG_UPPER, 57),
            (RULE_REF, 7),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        '\n        root  ::= (expr "=" ws term "\\n")+\n        expr  ::= term ([-+*/] term)*\n        term  ::= ident | num | "(" ws expr ")" ws\n        ident ::= [a-z] [a-z0-9_]* ws\n        num   ::= [0-9]+ ws\n        ws    ::= [ \\t\\n]*\n    ',
        [
            ("expr", 2),
            ("expr_6", 6),
            ("expr_7", 7),
            ("ident", 8),
            ("ident_10", 10),
            ("num", 9),
            ("num_11", 11),
            ("root", 0),
            ("root_1", 1),
            ("root_5", 5),
            ("term", 4),
            ("ws", 3),
            ("ws_12", 12),
        ],
        [
            (RULE_REF, 1),
            (RULE_REF, 5),
            (END, 0),
            (RULE_REF, 2),
            (CHAR, 61),
            (RULE_REF, 3),
            (RULE_REF, 4),
            (CHAR, 10),
            (END, 0),
            (RULE_REF, 4),
            (RULE_REF, 7),
            (END, 0),
            (RULE_REF, 12),
            (END, 0),
            (RULE_REF, 8),
            (ALT, 0),
            (RULE_REF, 9),
            (ALT, 0),
            (CHAR, 40),
            (RULE_REF, 3),
            (RULE_REF, 2),
            (CHAR, 41),
            (RULE_REF, 3),
            (END, 0),
            (RULE_REF, 1),
            (RULE_REF, 5),
            (ALT, 0),
            (END, 0),
            (CHAR, 45),
            (CHAR_ALT, 43),
            (CHAR_ALT, 42),
            (CHAR_ALT, 47),
            (RULE_REF, 4),
            (END, 0),
            (RULE_REF, 6),
            (RULE_REF, 7),
            (ALT, 0),
            (END, 0),
            (CHAR, 97),
            (CHAR_RNG_UPPER, 122),
            (RULE_REF, 10),
            (RULE_REF, 3),
            (END, 0),
            (CHAR, 48),
            (CHAR_RNG_UPPER, 57),
            (RULE_REF, 11),
            (RULE_REF, 3),
            (END, 0),
            (CHAR, 97),
            (CHAR_RNG_UPPER, 122),
            (CHAR_ALT, 48),
            (CHAR_RNG_UPPER, 57),
            (CHAR_ALT, 95),
            (RULE_REF, 10),
            (ALT, 0),
            (END, 0),
            (CHAR, 48),
            (CHAR_RNG_UPPER, 57),
            (RULE_REF, 11),
            (ALT, 0),
            (END, 0),
            (CHAR, 32),
            (CHAR_ALT, 9),
            (CHAR_ALT, 10),
            (RULE_REF, 12),
            (ALT, 0),
            (END, 0),
        ],
    ),
    (
        "\n        root  ::= <[1000]> !<[1001]> <[1001]>\n    ",
        [("root", 0)],
        [
            (TOKEN, 1000),
            (TOKEN_NOT, 1001),
            (TOKEN, 1001),
            (END, 0),
        ],
    ),
]


@pytest.mark.parametrize("text", FAILURES)
def test_parser_failure(text):
    with pytest.raises(GrammarError):
        Grammar.parse(text)


@pytest.mark.parametrize("text,symbols,elements", PARSING)
def test_parser_structure(text, symbols, elements):
    g = Grammar.parse(text)
    assert g.symbol_ids == dict(symbols)
    flat = [(int(t), v) for rule in g.rules for t, v in rule]
    assert flat == [(int(t), v) for t, v in elements]


# -- test-grammar-integration.cpp -------------------------------------------------------------

# (kind, grammar or schema, passing, failing); a string is text, a list mixes text and T(id)
CASES = [
    # min 0
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": 0\n        }',
        ["0", "10", "12", "10000"],
        [
            "-1",
            "-10",
            "-10000",
            "-100000000000000000000000000000000",
            "100000000000000000000000000000000",
            "00",
            "01",
            "-0",
        ],
    ),
    # min 2
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": 2\n        }',
        ["2", "3", "4", "10", "20", "1234567890000000"],
        ["0", "1", "-1", "-100", "0", "1", "01", "02", "12345678900000000"],
    ),
    # min 456
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": 456\n        }',
        ["456", "4560", "457", "460", "500"],
        ["455", "356", "50", "050", "-1", "-456"],
    ),
    # min -123
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": -123\n        }',
        ["-123", "-122", "-11", "-1", "0", "1", "123", "1234", "2345"],
        ["-1234", "-124"],
    ),
    # max 9999
    (
        "test_schema",
        '{\n            "type": "integer",\n            "maximum": 9999\n        }',
        ["-99999", "0", "9999"],
        ["10000", "99991"],
    ),
    # max -9999
    (
        "test_schema",
        '{\n            "type": "integer",\n            "maximum": -9999\n        }',
        ["-10000", "-9999"],
        ["-9998", "0", "9999"],
    ),
    # min 5 max 30
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": 5,\n            "maximum": 30\n        }',
        ["5", "10", "30"],
        ["05", "4", "-1", "31", "123", "0123"],
    ),
    # min 1 max 900719925474091
    (
        "test_schema",
        '{\n            "type": "integer",\n            "exclusiveMinimum": 0,\n            "maximum": 900719925474091\n        }',
        ["1", "2", "10", "900719925474090", "900719925474091"],
        ["0", "01", "900719925474092", "9007199254740910"],
    ),
    # min -1 max 1
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": -1,\n            "maximum": 1\n        }',
        ["-1", "0", "1"],
        ["-11", "-10", "-2", "2", "10", "11"],
    ),
    # min -123 max 42
    (
        "test_schema",
        '{\n            "type": "integer",\n            "minimum": -123,\n            "maximum": 42\n        }',
        ["-123", "-122", "-13", "-11", "-2", "-1", "0", "1", "5", "10", "39", "40", "42"],
        ["-0123", "-124", "-1123", "-200", "43", "123", "0123"],
    ),
    # exclusive min / max
    (
        "test_schema",
        '{\n            "type": "integer",\n            "exclusiveMinimum": 0,\n            "exclusiveMaximum": 10000\n        }',
        ["1", "9999"],
        ["0", "01", "10000", "99999"],
    ),
    # simple grammar
    (
        "test_grammar",
        '\n            root ::= expr\n            expr ::= term ("+" term)*\n            term ::= number\n            number ::= [0-9]+',
        ["42", "1+2+3+4+5", "123+456"],
        ["+", "/ 3", "1+2+3+4+5+", "12a45"],
    ),
    # simple grammar with tokens
    (
        "test_grammar",
        "\n            root ::= <[10]> content <[11]>\n            content ::= (!<[11]>)*",
        [
            [T(10), "hello world", T(11)],
            [T(10), "text with ", T(12), " other tokens ", T(13), " mixed in", T(11)],
            [T(10), T(11)],
            [T(10), T(12), T(13), T(14), T(15), T(11)],
            [T(10), "a", T(11)],
        ],
        [
            [T(10), "missing end token"],
            [T(10)],
            ["missing start token", T(11)],
            [T(10), T(11), T(11)],
            [T(11), "wrong order", T(10)],
        ],
    ),
    # medium complexity grammar
    (
        "test_grammar",
        '\n            root ::= expression\n            expression ::= term ws (("+"|"-") ws term)*\n            term ::= factor ws (("*"|"/") ws factor)*\n            factor ::= number | variable | "(" expression ")" | function-call\n            number ::= [0-9]+\n            variable ::= [a-zA-Z_][a-zA-Z0-9_]*\n            function-call ::= variable ws "(" (expression ("," ws expression)*)? ")"\n            ws ::= [ \\t\\n\\r]?',
        [
            "42",
            "1*2*3*4*5",
            "x",
            "x+10",
            "x1+y2",
            "(a+b)*(c-d)",
            "func()",
            "func(x,y+2)",
            "a*(b+c)-d/e",
            "f(g(x),h(y,z))",
            "x + 10",
            "x1 + y2",
            "(a + b) * (c - d)",
            "func()",
            "func(x, y + 2)",
            "a * (b + c) - d / e",
            "f(g(x), h(y, z))",
            "123+456",
            "123*456*789-123/456+789*123",
            "123+456*789-123/456+789*123-456/789+123*456-789/123+456*789-123/456+789*123-456",
        ],
        [
            "+",
            "/ 3x",
            "x + + y",
            "a * / b",
            "func(,)",
            "func(x y)",
            "(a + b",
            "x + y)",
            "a + b * (c - d",
            "42 +",
            "x +",
            "x + 10 +",
            "(a + b) * (c - d",
            "func(",
            "func(x, y + 2",
            "a * (b + c) - d /",
            "f(g(x), h(y, z)",
            "123+456*789-123/456+789*123-456/789+123*456-789/123+456*789-123/456+789*123-456/",
        ],
    ),
    # complex grammar with tokens
    (
        "test_grammar",
        "\n            root ::= reasoning+ content tool-call*\n            reasoning ::= <[10]> (!<[11]>)* <[11]>\n            content ::= <[20]> (!<[21]>)* <[21]>\n            tool-call ::= <[12]> name <[13]> args <[14]>\n            name ::= (!<[13]>)+\n            args ::= (!<[14]>)*",
        [
            [
                T(10),
                "I am thinking",
                T(11),
                T(20),
                "hello world!",
                T(21),
                T(12),
                "search",
                T(13),
                "query=test",
                T(14),
            ],
            [
                T(10),
                "reasoning 1",
                T(11),
                T(10),
                "reasoning 2",
                T(11),
                T(20),
                T(21),
                T(12),
                "tool",
                T(13),
                T(14),
            ],
            [T(10), T(11), T(20), "content", T(21)],
            [
                T(10),
                "think",
                T(12),
                " nested",
                T(11),
                T(20),
                T(10),
                "more content",
                T(21),
                T(12),
                "fn",
                T(13),
                "x=1,y=2",
                T(14),
                T(12),
                "fn2",
                T(13),
                T(14),
            ],
            [
                T(10),
                "reasoning",
                T(11),
                T(10),
                "more",
                T(11),
                T(10),
                "even more",
                T(11),
                T(20),
                "text",
                T(21),
                T(12),
                "a",
                T(13),
                "b",
                T(14),
                T(12),
                "c",
                T(13),
                "d",
                T(14),
            ],
        ],
        [
            [T(20), "content only", T(21)],
            [T(10), "no closing reasoning"],
            [T(10), T(11), T(20), "no closing content"],
            [T(10), T(11), T(20), T(21), T(12), "incomplete tool"],
            [T(10), T(11), T(11), T(20), T(21)],
        ],
    ),
    # special characters
    (
        "test_grammar",
        '\n            root ::= ... "abc" ...\n            ',
        ["abcabcabc", "aaaabcccc", "🔵🟠✅abc❌🟠🔵"],
        ["aaabcccc", "aaaaabcccc", "aaaabccc", "aaaabccccc", "🔵🟠✅❌abc❌✅🟠🔵", "🔵🟠abc🟠🔵"],
    ),
    # * quantifier
    (
        "test_grammar",
        'root ::= "a"*',
        [
            "",
            "a",
            "aaaaa",
            "aaaaaaaaaaaaaaaaaa",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ],
        ["b", "ab", "aab", "ba", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"],
    ),
    # + quantifier
    (
        "test_grammar",
        'root ::= "a"+',
        [
            "a",
            "aaaaa",
            "aaaaaaaaaaaaaaaaaa",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ],
        [
            "",
            "b",
            "ab",
            "aab",
            "ba",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab",
        ],
    ),
    # ? quantifier
    ("test_grammar", 'root ::= "a"?', ["", "a"], ["b", "ab", "aa", "ba"]),
    # mixed quantifiers
    (
        "test_grammar",
        "\n            root ::= cons+ vowel* cons? (vowel cons)*\n            vowel ::= [aeiouy]\n            cons ::= [bcdfghjklmnpqrstvwxyz]\n            ",
        ["yes", "no", "noyes", "crwth", "four", "bryyyy"],
        ["yess", "yesno", "forty", "catyyy"],
    ),
    # simple exact repetition
    (
        "test_grammar",
        "\n            root ::= [ab]{4}\n        ",
        ["aaaa", "bbbb", "abab"],
        ["a", "b", "aaaaa"],
    ),
    # simple min repetition
    (
        "test_grammar",
        "\n            root ::= [ab]{4,}\n        ",
        ["aaaa", "aaaaab", "bbbb", "ababab"],
        ["", "aba"],
    ),
    # simple max repetition
    (
        "test_grammar",
        "\n            root ::= [ab]{0,4}\n        ",
        ["", "a", "aa", "aaa", "aaab"],
        ["aaaaa"],
    ),
    # min / max repetition
    (
        "test_grammar",
        '\n            root ::= ("0x" [A-F0-9]{2} " "?){3,5}\n        ',
        ["0xFF 0x12 0xAB", "0xFF 0x12 0xAB 0x00 0x00"],
        ["", "0xFF", "0xFF 0x12", "0xFF 0x12 0xAB 0x00 0x00 0x00"],
    ),
    # segfault
    ("test_grammar", "\n            root ::= ( [x]* )*\n        ", ["", "x", "xx"], ["y", "yy"]),
    # empty schema (any value)
    (
        "test_schema",
        "\n            {}\n        ",
        ["{}", '{"foo": "bar"}', "[]", "null", '""', "true"],
        ["", '{"foo"}', "foo"],
    ),
    # exotic formats (list)
    (
        "test_schema",
        '{\n            "items": [\n                { "format": "date" },\n                { "format": "uuid" },\n                { "format": "time" },\n                { "format": "date-time" }\n            ]\n        }',
        [
            '["2012-04-23", "12345678-1234-1234-1234-1234567890ab", "18:25:43.511Z", "2012-04-23T18:25:43.511Z"]'
        ],
        ['["foo", "bar"]', '["12345678-1234-1234-1234-1234567890ab"]'],
    ),
    # string
    (
        "test_schema",
        '{\n            "type": "string"\n        }',
        ['"foo"', '"bar"', '""'],
        ["{}", '"foo": "bar"'],
    ),
    # string w/ min length 1
    (
        "test_schema",
        '{\n            "type": "string",\n            "minLength": 1\n        }',
        ['"foo"', '"bar"'],
        ['""', "{}", '"foo": "bar"'],
    ),
    # string w/ min length 3
    (
        "test_schema",
        '{\n                "type": "string",\n                "minLength": 3\n        }',
        ['"foo"', '"bar"', '"foobar"'],
        ['""', '"f"', '"fo"'],
    ),
    # string w/ max length
    (
        "test_schema",
        '{\n            "type": "string",\n            "maxLength": 3\n        }',
        ['"foo"', '"bar"', '""', '"f"', '"fo"'],
        ['"foobar"'],
    ),
    # string w/ min & max length
    (
        "test_schema",
        '{\n            "type": "string",\n            "minLength": 1,\n            "maxLength": 4\n        }',
        ['"foo"', '"bar"', '"f"', '"barf"'],
        ['""', '"barfo"', '"foobar"'],
    ),
    # boolean
    (
        "test_schema",
        '{\n            "type": "boolean"\n        }',
        ["true", "false"],
        ['""', '"true"', "True", "FALSE"],
    ),
    # integer
    (
        "test_schema",
        '{\n            "type": "integer"\n        }',
        ["0", "12345", "1234567890123456"],
        ["", "01", "007", "12345678901234567  "],
    ),
    # string const
    ("test_schema", '{\n            "const": "foo"\n        }', ['"foo"'], ["foo", '"bar"']),
    # non-string const
    ("test_schema", '{\n            "const": true\n        }', ["true"], ["", "foo", '"true"']),
    # non-string const
    (
        "test_schema",
        '{\n            "enum": ["red", "amber", "green", null, 42, ["foo"]]\n        }',
        ['"red"', "null", "42", '["foo"]'],
        ["", "420", "true", "foo"],
    ),
    # simple pattern
    (
        "test_schema",
        '{\n            "pattern": "^[a-zA-Z0-9_-]*$"\n        }',
        ['""', '"He_llo-12"'],
        ['"!"', '"Hello World"'],
    ),
    # pattern with escapes
    (
        "test_schema",
        '{\n            "pattern": "^a\\\\^\\\\$\\\\.\\\\[\\\\]\\\\(\\\\)\\\\|\\\\{\\\\}\\\\*\\\\+\\\\?b$"\n        }',
        ['"a^$.[]()|{}*+?b"'],
        ['"ab"'],
    ),
    (
        "test_schema",
        '\n            {\n                "type": ["array", "null"],\n                "items": { "type": "string" }\n            }\n        ',
        ["null", "[]", '["123"]', '["foo", "bar"]'],
        ["", "[123]", '"foo"', '["foo", 42]'],
    ),
    # min+max items
    (
        "test_schema",
        '{\n            "items": {\n                "type": ["number", "integer"]\n            },\n            "minItems": 3,\n            "maxItems": 5\n        }',
        ["[1, 2, 3]", "[1, 2, 3, 4]", "[1, 2, 3, 4, 5]"],
        ["[1, 2]", "[1, 2, 3, 4, 5, 6]", "1"],
    ),
    # object properties
    (
        "test_schema",
        '{\n            "type": "object",\n            "properties": {\n                "number": { "type": "number" },\n                "street_name": { "type": "string" },\n                "street_type": { "enum": ["Street", "Avenue", "Boulevard"] }\n            }\n        }',
        [
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type":"Avenue"}',
            '{ "street_name": "Pennsylvania" }',
            '{ "number": 1600, "street_name": "Pennsylvania" }',
            "{}",
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type": "Avenue" }',
        ],
        [
            '{ "number": "1600", "street_name": "Pennsylvania", "street_type":"Avenue"}',
            '{ "street_name": "Pennsylvania", "number": 1600 }',
            '{ "number": "1600", "street_name": "Pennsylvania", "street_type":"Avenue"}',
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type":"Avenue", "direction":"NW"}',
        ],
    ),
    # additional properties can't override other properties
    (
        "test_schema",
        '{\n            "properties": {\n                "a": {"type": "integer"},\n                "b": {"type": "integer"}\n            },\n            "additionalProperties": true\n        }',
        ['{"a": 42}', '{"c": ""}', '{"a": 42, "c": ""}', '{"a_": ""}'],
        ["", '{"a": ""}', '{"a": "", "b": ""}'],
    ),
    # object properties, additionalProperties: true
    (
        "test_schema",
        '{\n            "type": "object",\n            "properties": {\n                "number": { "type": "number" },\n                "street_name": { "type": "string" },\n                "street_type": { "enum": ["Street", "Avenue", "Boulevard"] }\n            },\n            "additionalProperties": true\n        }',
        [
            "{}",
            '{"number":1600,"street_name":"Pennsylvania","street_type":"Avenue"}',
            '{ "street_name": "Pennsylvania" }',
            '{ "number": 1600, "street_name": "Pennsylvania" }',
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type":"Avenue", "direction":"NW"}',
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type": "Avenue" }',
        ],
        [
            '{ "number": "1600", "street_name": "Pennsylvania", "street_type":"Avenue"}',
            '{ "street_name": "Pennsylvania", "number": 1600, "street_type":"Avenue"}',
        ],
    ),
    # required + optional props each in original order
    (
        "test_schema",
        '{\n            "type": "object",\n            "properties": {\n                "number": { "type": "number" },\n                "street_name": { "type": "string" },\n                "street_type": { "enum": ["Street", "Avenue", "Boulevard"] }\n            },\n            "additionalProperties": false\n        }',
        [
            '{ "street_name": "Pennsylvania" }',
            '{ "number": 1600, "street_type":"Avenue"}',
            '{ "number": 1600, "street_name": "Pennsylvania" }',
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type":"Avenue"}',
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type": "Avenue" }',
        ],
        [
            '{ "street_type": "Avenue", "number": 1600 }',
            '{ "number": 1600, "street_name": "Pennsylvania", "street_type": "Avenue", "direction": "NW" }',
        ],
    ),
    # required + optional props each in original order
    (
        "test_schema",
        '{\n            "properties": {\n                "b": {"type": "string"},\n                "a": {"type": "string"},\n                "d": {"type": "string"},\n                "c": {"type": "string"}\n            },\n            "required": ["a", "b"],\n            "additionalProperties": false\n        }',
        [
            '{"b": "foo", "a": "bar"}',
            '{"b":"foo","a":"bar","d":"qux"}',
            '{"b":"foo", "a":"bar", "d":"qux", "c":"baz"}',
        ],
        [
            '{"a": "foo", "b": "bar"}',
            '{"b": "bar"}',
            '{"a": "foo", "c": "baz"}',
            '{"a":"foo", "b":"bar", "c":"baz", "d":"qux"}',
        ],
    ),
    # required props
    (
        "test_schema",
        '{\n            "$schema": "https://json-schema.org/draft/2020-12/schema",\n            "$id": "https://example.com/product.schema.json",\n            "title": "Product",\n            "description": "A product from Acme\'s catalog",\n            "type": "object",\n            "properties": {\n                "productId": {\n                "description": "The unique identifier for a product",\n                "type": "integer"\n                },\n                "productName": {\n                "description": "Name of the product",\n                "type": "string"\n                },\n                "price": {\n                "description": "The price of the product",\n                "type": "number",\n                "exclusiveMinimum": 0\n                },\n                "tags": {\n                "description": "Tags for the product",\n                "type": "array",\n                "items": {\n                    "type": "string"\n                },\n                "minItems": 1,\n                "uniqueItems": true\n                },\n                "dimensions": {\n                "type": "object",\n                "properties": {\n                    "length": {\n                    "type": "number"\n                    },\n                    "width": {\n                    "type": "number"\n                    },\n                    "height": {\n                    "type": "number"\n                    }\n                },\n                "required": [ "length", "width", "height" ]\n                }\n            },\n            "required": [ "productId", "productName", "price" ]\n        }',
        [
            '{"productId": 1, "productName": "A green door", "price": 12.50}',
            '{"productId": 1, "productName": "A green door", "price": 12.50, "tags": ["home", "green"]}',
            '{"productId": 1, "productName": "A green door", "price": 12.50, "tags": ["home", "green"], "dimensions": {"length": 785, "width": 250.5, "height": -0.359}}',
        ],
        [
            "{}",
            '{"productName": "A green door", "price": 12.50, "productId": 1}',
            '{"productId": 1, "productName": "A green door"}',
            '{"productName": "A green door", "price": 12.50}',
            '{"productId": 1, "productName": "A green door", "price": 12.50, "tags": []}',
            '{"productId": 1, "productName": "A green door", "price": 12.50, "dimensions": {"length": 785, "width": 250.5, "height": -0.359}, "tags": ["home", "green"]}',
        ],
    ),
]

# Schemas with keywords a grammar cannot enforce; llama.cpp ignores them, as strict=False does
LENIENT = {"uniqueItems"}


def _parts(item):
    return item if isinstance(item, list) else [item]


def match_string(grammar: Grammar, item) -> bool:
    """llama.cpp's match_string: text one code point at a time as token 0, T(id) as token id."""
    m = grammar.matcher()
    for part in _parts(item):
        if isinstance(part, T):
            pieces = [(int(part), f"<[{int(part)}]>".encode())]
        else:
            pieces = [(0, ch.encode("utf-8")) for ch in part]
        for token_id, piece in pieces:
            try:
                m.accept_token(token_id, piece)
            except GrammarError:
                return False
    return m.can_end()


def _build(kind, text):
    if kind == "test_grammar":
        return Grammar.parse(text)
    strict = not any(k in text for k in LENIENT)
    return Grammar.parse(schema_to_gbnf(json.loads(text), strict=strict))


@pytest.mark.parametrize(
    "kind,text,passing,failing", CASES, ids=[f"{c[0][5:]}-{i}" for i, c in enumerate(CASES)]
)
def test_integration(kind, text, passing, failing):
    g = _build(kind, text)
    for item in passing:
        assert match_string(g, item), f"should match: {item!r}"
    for item in failing:
        assert not match_string(g, item), f"should not match: {item!r}"


def test_missing_root():
    text = """
        rot ::= expr
        expr ::= term ("+" term)*
        term ::= number
        number ::= [0-9]+"""
    with pytest.raises(GrammarError, match="root"):
        Grammar.parse(text)


def test_missing_reference():
    text = """root ::= expr
        expr ::= term ("+" term)*
        term ::= numero
        number ::= [0-9]+"""
    with pytest.raises(GrammarError, match="numero") as err:
        Grammar.parse(text)
    assert (err.value.line, err.value.column) == (3, 18)


@pytest.mark.parametrize(
    "text",
    [
        'root ::= "a" | root "a"',
        """
        root ::= asdf
        asdf ::= "a" | asdf "a"
        """,
        """
        root ::= asdf
        asdf ::= "a" | foo "b"
        foo ::= "c" | asdf "d" | "e"
        """,
        """
        root ::= asdf
        asdf ::= "a" | foo "b"
        foo ::= "c" | empty asdf "d" | "e"
        empty ::= "blah" | """,
    ],
)
def test_left_recursion(text):
    with pytest.raises(GrammarError, match="left recursion"):
        Grammar.parse(text)


def test_missing_root_symbol():
    with pytest.raises(GrammarError, match="nonexistent"):
        Grammar.parse('root ::= "foobar"', root="nonexistent")


def test_custom_root_symbol():
    text = 'foobar ::= "foobar"'
    with pytest.raises(GrammarError):
        Grammar.parse(text)
    g = Grammar.parse(text, root="foobar")
    assert g.accepts("foobar") and not g.accepts("foo")
