"""Where Numba keeps picollama's compiled kernels: a directory named by the kernels' sources.

Numba's own cache key is the source file of each cached function, not the files whose code
it inlines. After a change to ``simd.py`` (say), a cached kernel in ``qdot.py`` keeps the
old machine code until ``qdot.py`` itself changes: still the right bits, since every
version is ggml-exact, but not the new speed. Numba's cache also does not know the
``PICOLLAMA_CPU_ISA`` setting. So the cache goes to a directory whose name hashes every
source file that compiled code can come from, and that setting:

    ${XDG_CACHE_HOME:-~/.cache}/picollama/jit/<16 hex digits>

A user's own ``NUMBA_CACHE_DIR`` wins. Directories of other sources left unused for
``STALE_DAYS`` are removed when a new one is made. Hashing the ~600 KB of sources costs
about a millisecond at import.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

__all__ = ["cache_dir", "configure", "source_key"]

# The folders (inside the package) whose modules hold compiled code or code it inlines.
SOURCE_DIRS = ("backends/cpu", "quant", "sampling")
STALE_DAYS = 14
# Set beside NUMBA_CACHE_DIR when picollama chose it, so that a child process (which
# inherits both) can tell its parent's choice from a user's and choose again: a child may
# run with another PICOLLAMA_CPU_ISA.
_CHOSEN = "PICOLLAMA_JIT_CACHE_CHOSEN"


def source_key(package: Path, isa: str) -> str:
    """16 hex digits of a hash of the compiled-code sources under ``package``, and ``isa``."""
    digest = hashlib.sha1(isa.encode())
    for folder in SOURCE_DIRS:
        for path in sorted((package / folder).glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """The directory picollama's kernels compile into when ``NUMBA_CACHE_DIR`` is not set."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"  # (RuntimeError: no home)
    package = Path(__file__).resolve().parent
    isa = os.environ.get("PICOLLAMA_CPU_ISA", "native")
    return root / "picollama" / "jit" / source_key(package, isa)


def _prune(chosen: Path) -> None:
    """Remove sibling directories (other sources) left unused for STALE_DAYS."""
    cutoff = time.time() - STALE_DAYS * 86400
    for other in chosen.parent.iterdir():
        try:
            stale = other != chosen and other.is_dir() and other.stat().st_mtime < cutoff
        except OSError:  # removed meanwhile by another process
            continue
        if stale:
            shutil.rmtree(other, ignore_errors=True)


def configure() -> None:
    """Point Numba's cache at ``cache_dir()`` unless the user chose one; call before any
    cached function is defined (``picollama/__init__.py`` does)."""
    user_choice = os.environ.get("NUMBA_CACHE_DIR")
    if user_choice and user_choice != os.environ.get(_CHOSEN):
        return
    try:
        chosen = cache_dir()
        fresh = not chosen.exists()
        chosen.mkdir(parents=True, exist_ok=True)
        os.utime(chosen)  # marks it in use, for _prune in other checkouts
    except (OSError, RuntimeError):
        return  # no home or not writable: Numba keeps its own choice (__pycache__ or none)
    if fresh:
        _prune(chosen)
    os.environ["NUMBA_CACHE_DIR"] = os.environ[_CHOSEN] = str(chosen)
    if "numba" in sys.modules:
        # Numba read its environment already (it reads it again only when a NUMBA_
        # variable changes, at its next compile): tell it directly too.
        from numba.core import config

        config.CACHE_DIR = str(chosen)
