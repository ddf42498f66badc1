"""picollama-cli's grammar flags: --grammar, --grammar-file, -j/--json-schema, -jf.

Generations run SmolLM2 in-process through ``main([...])``, greedy and short, and an
independent check (json.loads, jsonschema, string equality) judges each output. The error
cases need no model: a grammar or schema is checked before the model loads, which a
nonexistent -m proves (a model error would come first otherwise).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NESTED_SCHEMA, SMOLLM2

from picollama.tools.cli import main

GRAMMARS = Path(__file__).parent / "data" / "grammars"
NO_MODEL = "/nonexistent/model.gguf"
YES_NO = 'root ::= "yes" | "no"'

SCHEMA = NESTED_SCHEMA


def _chatml(message: str) -> str:
    """A one-turn SmolLM2 (ChatML) prompt, for completion mode."""
    return f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"


def _run(capsys, *args: str, stdin: str = "") -> tuple[int, str, str]:
    """main() on SmolLM2, greedy, small context; (exit status, stdout, stderr)."""
    argv = ["-m", SMOLLM2, "-c", "512", "--temp", "0", *args]
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)  # chat reads turns here; empty: one turn, then EOF
    try:
        rc = main(argv)
    finally:
        sys.stdin = old_stdin
    out, err = capsys.readouterr()
    return rc, out, err


def _error_line(capsys, *args: str) -> str:
    """The one stderr line of a grammar error, raised before the model loads."""
    rc = main(["-m", NO_MODEL, "-p", "x", *args])
    out, err = capsys.readouterr()
    assert rc == 1
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("picollama-cli: error: ")
    return lines[0]


# -- generation under a constraint ----------------------------------------------------------


@pytest.mark.model
def test_grammar_file_json_parses(smollm2_path, capsys):
    prompt = _chatml('Return a JSON object with one key, "city", set to Paris.')
    rc, out, err = _run(
        capsys,
        *("-p", prompt, "--no-display-prompt", "-n", "48"),
        *("--grammar-file", str(GRAMMARS / "json.gbnf")),
    )
    assert rc == 0, err
    assert isinstance(json.loads(out), dict), out


@pytest.mark.model
def test_grammar_yes_no_completion(smollm2_path, capsys):
    prompt = _chatml("Is Paris in France? Answer yes or no.")
    rc, out, err = _run(capsys, "-p", prompt, "--no-display-prompt", "-n", "8", "--grammar", YES_NO)
    assert rc == 0, err
    assert out in ("yes\n", "no\n"), repr(out)


@pytest.mark.model
def test_json_schema_chat_validates(smollm2_path, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    question = "Describe a small dog as JSON."
    rc, out, err = _run(capsys, "-cnv", "-p", question, "-n", "96", "-j", json.dumps(SCHEMA))
    assert rc == 0, err
    # chat echoes the first message, prints the answer, then prompts again (EOF ends it)
    assert out.startswith(f"> {question}\n") and out.endswith("\n\n> "), repr(out)
    answer = out.removeprefix(f"> {question}\n").removesuffix("\n\n> ")
    jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.mark.model
def test_grammar_constrains_each_chat_answer(smollm2_path, capsys):
    # the grammar restarts with each answer: without that the second would be empty,
    # the grammar being complete after the first
    turns = "Is water wet? Answer yes or no.\nIs fire cold? Answer yes or no.\n"
    rc, out, err = _run(capsys, "-cnv", "-n", "8", "--grammar", YES_NO, stdin=turns)
    assert rc == 0, err
    # input() prompts "\n> " on stdout (the piped turns are not echoed): one answer each
    answers = out.split("\n> ")
    assert answers[0] == "" and answers[-1] == "", repr(out)
    assert [a in ("yes\n", "no\n") for a in answers[1:-1]] == [True, True], repr(out)


@pytest.mark.model
def test_json_schema_file_enum(smollm2_path, capsys, tmp_path):
    schema = tmp_path / "color.json"
    schema.write_text('{"enum": ["red", "green", "blue"]}', encoding="utf-8")
    prompt = _chatml("Name a color of the French flag.")
    rc, out, err = _run(capsys, "-p", prompt, "--no-display-prompt", "-n", "8", "-jf", str(schema))
    assert rc == 0, err
    assert json.loads(out) in ("red", "green", "blue"), repr(out)


# -- errors: one line on stderr, exit status 1 (2 for a usage error), no traceback ----------


def test_broken_grammar_names_line_and_column(capsys):
    grammar = 'root ::= answer\nanswer ::= "yes" | "no"\n\nunused ::= "a"  maybe'
    line = _error_line(capsys, "--grammar", grammar)
    assert line == "picollama-cli: error: grammar: line 4, column 17: undefined rule 'maybe'"


def test_unterminated_literal(capsys):
    line = _error_line(capsys, "--grammar", 'root ::= "yes')
    assert line == "picollama-cli: error: grammar: line 1, column 10: unterminated literal"


def test_broken_grammar_file_names_the_file(capsys, tmp_path):
    path = tmp_path / "bad.gbnf"
    path.write_text("root ::= item+\nitem ::= [a-z\n", encoding="utf-8")
    line = _error_line(capsys, "--grammar-file", str(path))
    assert line.startswith(f"picollama-cli: error: grammar file {str(path)!r}: line 2, column ")
    assert "unterminated character class" in line


def test_empty_grammar_file(capsys, tmp_path):
    path = tmp_path / "empty.gbnf"
    path.write_text("", encoding="utf-8")
    assert "empty grammar" in _error_line(capsys, "--grammar-file", str(path))


@pytest.mark.parametrize("flag", ["--grammar-file", "--json-schema-file", "-jf"])
def test_missing_file(capsys, tmp_path, flag):
    path = tmp_path / "missing"
    line = _error_line(capsys, flag, str(path))
    assert "cannot read" in line and repr(str(path)) in line
    assert "No such file or directory" in line


def test_invalid_json_schema(capsys):
    line = _error_line(capsys, "-j", '{"type": "object",}')
    assert line.startswith("picollama-cli: error: json schema: $: schema is not valid JSON: ")


def test_json_schema_file_not_json(capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text("type: object\n", encoding="utf-8")
    line = _error_line(capsys, "--json-schema-file", str(path))
    assert line.startswith(f"picollama-cli: error: json schema file {str(path)!r}: $: ")
    assert "not valid JSON" in line


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (
            {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
            "json schema: $.properties.a.not: keyword 'not' cannot be enforced by a grammar",
        ),
        ({"type": "strin"}, "json schema: $.type: unknown type 'strin'"),
        (
            {"items": {"$ref": "https://example.com/item.json"}},
            "json schema: $.items.$ref: $ref 'https://example.com/item.json': "
            "only local references ('#...') are supported",
        ),
    ],
)
def test_json_schema_we_cannot_express(capsys, schema, expected):
    assert _error_line(capsys, "-j", json.dumps(schema)) == f"picollama-cli: error: {expected}"


@pytest.mark.parametrize(
    "pair",
    [
        ("--grammar", YES_NO, "-j", "{}"),
        ("--grammar-file", "a.gbnf", "--grammar", YES_NO),
        ("-j", "{}", "-jf", "schema.json"),
    ],
)
def test_two_constraints_are_a_usage_error(capsys, pair):
    with pytest.raises(SystemExit) as exc:
        main(["-m", NO_MODEL, "-p", "x", *pair])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("picollama-cli: error: argument ")
    assert "not allowed with argument" in err


def test_error_from_the_console_is_one_line():
    # the installed entry point's view: exit status 1, one line, no traceback
    r = subprocess.run(
        [sys.executable, "-m", "picollama.tools.cli", "-m", NO_MODEL, "-p", "x"]
        + ["--grammar", "root ::= foo"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr == "picollama-cli: error: grammar: line 1, column 10: undefined rule 'foo'\n"
