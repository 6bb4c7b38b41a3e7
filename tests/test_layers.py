"""The layering of docs/architecture.md, read off the source: which package may import which,
and no import cycles among module-level imports."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "jaxkv", "serve")

# package prefix -> prefixes it must never import (at module level or inside functions)
FORBIDDEN = {
    "pallas_kernels": ("jaxkv", "serve"),
    "jaxkv": ("serve",),
    "jaxkv.core": ("jaxkv.engine", "jaxkv.runner", "jaxkv.models", "jaxkv.loader", "jax", "flax"),
    "jaxkv.runner": ("jaxkv.engine", "jaxkv.core.request", "jaxkv.core.scheduler"),
    "jaxkv.models": ("jaxkv.engine", "jaxkv.runner", "jaxkv.core"),
    "jaxkv.attention": ("jaxkv.engine", "jaxkv.runner", "jaxkv.core", "jaxkv.models"),
}


def modules():
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, f, parts[-1] == "__init__"


def imports(name, path, is_pkg, top_level_only=False):
    """Absolute names imported by a module (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            yield mod
            yield from (f"{mod}.{a.name}" for a in node.names)


def _under(name, prefix):
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_reaches_up():
    bad = []
    for name, path, is_pkg in modules():
        for layer, banned in FORBIDDEN.items():
            if _under(name, layer):
                bad += [(name, imp) for imp in set(imports(name, path, is_pkg))
                        for b in banned if _under(imp, b)]
    assert not bad, bad


def test_no_import_cycles_at_module_level():
    names = {n for n, _, _ in modules()}
    graph = {}
    for name, path, is_pkg in modules():
        # A module importing its own package's names is not a cycle (the package is loading).
        deps = {i for i in imports(name, path, is_pkg, top_level_only=True)
                if i in names and i != name and not _under(name, i)}
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for d in graph[n]:
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack + [n, d])}")
            if d not in state:
                visit(d, stack + [n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


def test_host_bookkeeping_loads_no_jax():
    """Importing the scheduler (and with it the whole of jaxkv.core) loads neither JAX nor Flax."""
    import subprocess
    import sys
    code = ("import sys, jaxkv.core.scheduler, jaxkv.core.kv_budget; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip()
    assert out == "[]", out
