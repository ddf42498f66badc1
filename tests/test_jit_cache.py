"""Where compiled kernels are cached: a directory per version of the kernels' sources."""

import os
import subprocess
import sys
import time

import numba.core.config
import pytest

from picollama import jit_cache


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """Numba's setting and the variables restored after the test; the cache under tmp_path."""
    monkeypatch.setattr(numba.core.config, "CACHE_DIR", numba.core.config.CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name in ("NUMBA_CACHE_DIR", jit_cache._CHOSEN, "PICOLLAMA_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_key_follows_every_kernel_source_and_the_isa(tmp_path):
    for folder in jit_cache.SOURCE_DIRS:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    first = jit_cache.source_key(tmp_path, "native")
    assert jit_cache.source_key(tmp_path, "native") == first
    assert jit_cache.source_key(tmp_path, "avx2") != first
    for folder in jit_cache.SOURCE_DIRS:
        (tmp_path / folder / "a.py").write_text("x = 2\n")
        changed = jit_cache.source_key(tmp_path, "native")
        assert changed != first, folder
        first = changed
    (tmp_path / "server.py").write_text("not kernel code\n")  # outside: no new key
    assert jit_cache.source_key(tmp_path, "native") == first


def test_configure_points_numba_at_the_source_directory(clean_env):
    jit_cache.configure()
    chosen = jit_cache.cache_dir()
    assert chosen.is_dir() and chosen.is_relative_to(clean_env / "xdg" / "picollama" / "jit")
    assert os.environ["NUMBA_CACHE_DIR"] == str(chosen)
    assert numba.core.config.CACHE_DIR == str(chosen)


def test_a_users_numba_cache_dir_wins(clean_env, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(clean_env / "mine"))
    jit_cache.configure()
    assert os.environ["NUMBA_CACHE_DIR"] == str(clean_env / "mine")
    assert not (clean_env / "xdg").exists()


def test_a_child_with_another_isa_chooses_again(clean_env, monkeypatch):
    jit_cache.configure()
    native = os.environ["NUMBA_CACHE_DIR"]
    env = dict(os.environ, PICOLLAMA_CPU_ISA="generic")
    code = "import os, picollama; print(os.environ['NUMBA_CACHE_DIR'])"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() not in ("", native)


def test_unused_directories_of_other_sources_are_removed(clean_env):
    root = clean_env / "xdg" / "picollama" / "jit"
    old, recent = root / "0123456789abcdef", root / "fedcba9876543210"
    for folder in (old, recent):
        folder.mkdir(parents=True)
        (folder / "k.nbi").write_bytes(b"x")
    long_ago = time.time() - (jit_cache.STALE_DAYS + 1) * 86400
    os.utime(old, (long_ago, long_ago))
    jit_cache.configure()
    assert not old.exists() and recent.exists() and jit_cache.cache_dir().exists()


def test_an_unwritable_cache_root_leaves_numba_alone(clean_env, monkeypatch):
    blocker = clean_env / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    before = numba.core.config.CACHE_DIR
    jit_cache.configure()
    assert "NUMBA_CACHE_DIR" not in os.environ
    assert numba.core.config.CACHE_DIR == before
