"""The C++ kernels' build (jaxkv/cpu_kernels/build.py): a second build with the same key is
reused, a changed header builds anew, a failing compiler's message is reported and leaves
nothing half-written, every .cc and .h of the package is compiled or keyed, $CXX is split as a
shell would, and the engine refuses the "cpu" backend (or falls back from "auto") where the
kernels cannot be built."""

import pytest

from jaxkv.cpu_kernels import build


def test_build_is_cached_and_failure_is_reported(tmp_path, monkeypatch):
    """A second build with the same key reuses the library; a compiler that fails gives its
    message, and no half-written library is left behind."""
    cxx = build._compiler()
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(tmp_path))
    first = build._build(cxx)
    stamp = first.stat().st_mtime_ns
    assert build._build(cxx) == first and first.stat().st_mtime_ns == stamp
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match=r"failed \(exit status 1\): .*bad.cc"):
        build._build(cxx, (build.SOURCES[0], bad))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, "bad.cc"])


def test_a_header_change_builds_anew(tmp_path, monkeypatch):
    """The headers' text is in the build's key: the same source with a changed header gives a
    new library (the old one stays, for builds that still match it)."""
    cxx = build._compiler()
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(tmp_path / "cache"))
    header, source = tmp_path / "work_sharing.h", tmp_path / "tiny.cc"
    header.write_text("inline int answer() { return 42; }\n")
    source.write_text('#include "work_sharing.h"\nint jaxkv_tiny() { return answer(); }\n')
    first = build._build(cxx, (source,), (header,))
    assert build._build(cxx, (source,), (header,)) == first
    header.write_text("inline int answer() { return 43; }\n")
    second = build._build(cxx, (source,), (header,))
    assert second != first and first.exists() and second.exists()


def test_every_source_and_header_of_the_package_is_built_or_keyed():
    here = build.SOURCES[0].parent
    assert sorted(build.SOURCES) == sorted(here.glob("*.cc"))
    assert sorted(build.HEADERS) == sorted(here.glob("*.h"))


def test_compiler_command(monkeypatch):
    monkeypatch.setenv("CXX", "ccache g++ -Wno-foo")
    assert build._compiler() == ["ccache", "g++", "-Wno-foo"]
    monkeypatch.delenv("CXX")
    assert build._compiler()[0].endswith(("g++", "c++"))


def test_engine_refuses_cpu_backend_where_it_cannot_run(monkeypatch, caplog):
    """Explicit "cpu" off a CPU, or with replicated KV heads under tensor parallelism, is a
    ValueError; "auto" falls back to xla with a warning when the kernel cannot be built."""
    from types import SimpleNamespace

    from jaxkv.engine_config import resolve_backend
    mc = SimpleNamespace(num_kv_heads=3)
    check = build.unavailable
    with pytest.raises(ValueError, match="CPU only, not on gpu"):
        resolve_backend("cpu", "gpu", mc, 1, check)
    with pytest.raises(ValueError, match=r"KV heads \(3\)"):
        resolve_backend("cpu", "cpu", mc, 4, check)
    assert resolve_backend("auto", "cpu", mc, 4, check) == "xla"
    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(build, "_error", "no C++ compiler found")
    with pytest.raises(ValueError, match="cannot be built: no C\\+\\+ compiler"):
        resolve_backend("cpu", "cpu", mc, 1, check)
    import logging
    log = logging.getLogger("jaxkv")  # it does not propagate to the root logger caplog watches
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="jaxkv"):
            assert resolve_backend("auto", "cpu", mc, 1, check) == "xla"
    finally:
        log.removeHandler(caplog.handler)
    assert "using the xla attention backend" in caplog.text
