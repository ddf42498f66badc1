"""Shared fixtures: the real built-in models, fetched by `make test` (picollama-models pull)."""

from __future__ import annotations

import pytest

from picollama.models.registry import ModelNotFoundError, resolve_model_path

SMOLLM2 = "smollm2-135m-instruct-q4_1"
GEMMA3 = "gemma3-270m-q4_k_m"


def model_path(name: str):
    """The cached file of a built-in model; a clear skip if this machine has not fetched it.

    `make test` fetches both models before the suite runs, so in CI these tests run.
    """
    try:
        return resolve_model_path(name)
    except ModelNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2_path():
    return model_path(SMOLLM2)


@pytest.fixture(scope="session")
def gemma3_path():
    return model_path(GEMMA3)


# a JSON schema with a nested object, an array and an enum, bounded so that a greedy answer
# ends well inside a few dozen tokens (the grammar tests of the API and the CLI)
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "first": {"type": "string", "maxLength": 10},
                "admin": {"type": "boolean"},
            },
            "required": ["first", "admin"],
        },
    },
    "required": ["name", "color", "sizes", "owner"],
}
