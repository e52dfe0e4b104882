"""The one cache-directory resolver shared by generators, learned inverters and Refiner's D."""
from pathlib import Path

from adaptive.inverter.cache import cache_path
from audit.core.cache import cache_dir


def test_cache_dir_env_default_and_root(monkeypatch, tmp_path):
    monkeypatch.delenv("GIA_AUDIT_CACHE", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "gia-audit"
    monkeypatch.setenv("GIA_AUDIT_CACHE", "")
    assert cache_dir("a") == Path.home() / ".cache" / "gia-audit" / "a"
    monkeypatch.setenv("GIA_AUDIT_CACHE", str(tmp_path))
    assert cache_dir("generators", "g.pt") == tmp_path / "generators" / "g.pt"
    assert cache_path("k") == tmp_path / "learned-inverter" / "k.pt"
    assert cache_dir("x", root=tmp_path / "other") == tmp_path / "other" / "x"
