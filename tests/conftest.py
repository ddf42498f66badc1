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
