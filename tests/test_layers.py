"""The layering of docs/architecture.md, read off the source.

Every import that can run counts: module-level ones, function-level (lazy) ones, and the
packages an import executes on the way (`import a.b.c` runs a/b/__init__.py); imports under
`if TYPE_CHECKING:` never run and are left out, and so is a module's import of its own
ancestor packages (they are loading already). On that graph: no cycles at all; every import
goes to the importer's own layer or one below it, in the layer order of docs/architecture.md
(root modules such as `jaxkv.engine_config` are layers of their own there); and the finer
"never imports" rules hold for everything a module reaches, not only what it names.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "jaxkv", "serve")

# module prefix -> prefixes it must never reach through any chain of imports (external
# packages included: `jax` means jax itself, imported by a module of the prefix)
NEVER_REACHES = {
    "jaxkv.core": ("jaxkv.loader", "jaxkv.models", "jaxkv.attention", "jaxkv.step_input",
                   "jaxkv.cpu_kernels", "jax", "flax"),
    "jaxkv.runner": ("jaxkv.core.request", "jaxkv.core.scheduler"),  # never sees a Request
}


def modules(root: pathlib.Path = ROOT, packages=PACKAGES):
    """(dotted name, path, is_package) of every module under `packages`."""
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, f, parts[-1] == "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def imported_names(name: str, path: pathlib.Path, is_pkg: bool):
    """Absolute dotted names a module may import at run time (relative imports resolved);
    for `from a import b`, both `a` and `a.b` (b may be a submodule or an attribute)."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            yield mod
            yield from (f"{mod}.{a.name}" for a in node.names)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> tuple[dict, dict]:
    """(graph, external): graph maps each module to the project modules it executes when its
    imports run (the named module and the packages above it, not its own ancestors);
    external maps it to the top-level names of other packages it imports."""
    mods = list(modules(root, packages))
    names = {n for n, _, _ in mods}
    graph, external = {}, {}
    for name, path, is_pkg in mods:
        deps, ext = set(), set()
        for imp in imported_names(name, path, is_pkg):
            parts = imp.split(".")
            if parts[0] not in packages:
                ext.add(parts[0])
                continue
            for i in range(1, len(parts) + 1):  # the package chain down to the module named
                target = ".".join(parts[:i])
                if target in names and target != name and not _under(name, target):
                    deps.add(target)
        graph[name], external[name] = deps, ext
    return graph, external


def find_cycle(graph: dict) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for d in sorted(graph[n]):
            if state.get(d) == 1:  # d is on the current path: the circle closes
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d, stack + [d])
                if found:
                    return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n, [n])
            if found:
                return found
    return None


def layer_order(doc: str) -> list[tuple[str, ...]]:
    """The numbered list under '### Layer order' in docs/architecture.md: one tuple of the
    backticked module prefixes per layer, top first."""
    section = doc[doc.index("### Layer order"):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    return [tuple(re.findall(r"`([\w.]+)`", line))
            for line in section.splitlines() if re.match(r"\d+\. ", line)]


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """Index of the layer whose longest prefix matches `module`."""
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            if _under(module, p) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def upward_imports(graph: dict, layers: list[tuple[str, ...]]) -> list[str]:
    """'a (layer i) -> b (layer j)' for each import that goes to a higher layer (j < i), and
    'a: in no layer' for a module the order does not place."""
    bad = []
    for name in sorted(graph):
        i = layer_of(name, layers)
        if i is None:
            bad.append(f"{name}: in no layer")
            continue
        bad += [f"{name} (layer {i + 1}) -> {d} (layer {layer_of(d, layers) + 1})"
                for d in sorted(graph[name]) if (layer_of(d, layers) or 0) < i]
    return bad


def reach(graph: dict, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    return seen


def forbidden_reaches(graph: dict, external: dict, rules: dict) -> list[str]:
    bad = []
    for name in sorted(graph):
        for prefix, banned in rules.items():
            if not _under(name, prefix):
                continue
            reached = {name} | reach(graph, name)
            hits = {m for m in reached for b in banned if _under(m, b)}
            hits |= {f"{m} imports {e}" for m in reached for e in external[m] if e in banned}
            bad += [f"{name} reaches {h}" for h in sorted(hits)]
    return bad


def _doc_layers():
    return layer_order((ROOT / "docs" / "architecture.md").read_text())


def test_no_import_cycles_lazy_imports_included():
    graph, _ = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_every_import_goes_down_the_layer_order():
    graph, _ = import_graph()
    assert not upward_imports(graph, _doc_layers())


def test_never_reaches_rules_hold_transitively():
    graph, external = import_graph()
    assert not forbidden_reaches(graph, external, NEVER_REACHES)


def test_the_checks_catch_a_lazy_cycle_and_an_upward_root_import(tmp_path):
    """A made-up tree: a root module imported lazily by a lower package closes a circle, and
    a low layer reaches a high one only through a function-level import."""
    files = {
        "app/__init__.py": "",
        "app/config.py": "from app.low import helper\n",
        "app/low/__init__.py": "",
        "app/low/helper.py": "def f():\n    from app import config\n",
        "app/low/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from app import config\nimport jax\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph, external = import_graph(tmp_path, ("app",))
    assert graph["app.low.helper"] == {"app.config"}      # lazy import seen
    assert graph["app.low.typed"] == set()                 # TYPE_CHECKING import left out
    assert find_cycle(graph) in (["app.config", "app.low.helper", "app.config"],
                                 ["app.low.helper", "app.config", "app.low.helper"])
    layers = [("app", "app.config"), ("app.low",)]
    assert upward_imports(graph, layers) == ["app.low.helper (layer 2) -> app.config (layer 1)"]
    assert forbidden_reaches(graph, external, {"app.low": ("jax",)}) == [
        "app.low.typed reaches app.low.typed imports jax"]
    assert forbidden_reaches(graph, external, {"app.config": ("app.low.helper",)}) == [
        "app.config reaches app.low.helper"]


def test_the_layer_order_places_every_module():
    graph, _ = import_graph()
    layers = _doc_layers()
    assert len(layers) >= 10
    assert [m for m in graph if layer_of(m, layers) is None] == []


def test_host_bookkeeping_loads_no_jax():
    """Importing the scheduler (and with it the whole of jaxkv.core) loads neither JAX nor Flax."""
    import subprocess
    import sys
    code = ("import sys, jaxkv.core.scheduler, jaxkv.core.kv_budget; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip()
    assert out == "[]", out
