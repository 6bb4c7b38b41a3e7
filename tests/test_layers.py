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


def imports(name: str, path: pathlib.Path, is_pkg: bool, top_level_only: bool = False):
    """(module, names) for each import a module may run (relative imports resolved): `import
    a.b` gives ("a.b", None), `from a import b, c` gives ("a", ["b", "c"]) (each b a submodule
    or an attribute). top_level_only: the module's own body, not its functions' imports."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else _runtime_nodes(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            yield mod, [a.name for a in node.names]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _edges(name: str, found, names: set, packages) -> tuple[set, set]:
    """(project modules, other packages' top-level names) that the imports `found` run: the
    module named (or, for `from pkg import attr`, the package pkg itself, even the importer's
    own: it may still be loading) and the packages run on the way down to it, except the
    importer's own ancestors (already loading)."""
    deps, ext = set(), set()
    for mod, attrs in found:
        targets = [mod] if attrs is None else [
            f"{mod}.{a}" if f"{mod}.{a}" in names else mod for a in attrs]
        for t in targets:
            parts = t.split(".")
            if parts[0] not in packages:
                ext.add(parts[0])
                continue
            if t in names and t != name:
                deps.add(t)
            deps |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                     if p in names and not _under(name, p)}
    return deps, ext


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict:
    """The project's import graph: {"all": module -> modules its imports run (function-level
    ones included), "top": the same for its module-level imports only, "ext_all" / "ext_top":
    module -> other packages' top-level names}."""
    mods = list(modules(root, packages))
    names = {n for n, _, _ in mods}
    g = {"all": {}, "top": {}, "ext_all": {}, "ext_top": {}}
    for name, path, is_pkg in mods:
        g["all"][name], g["ext_all"][name] = _edges(name, imports(name, path, is_pkg), names, packages)
        g["top"][name], g["ext_top"][name] = _edges(
            name, imports(name, path, is_pkg, top_level_only=True), names, packages)
    return g


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
    """Index of the layer whose entry matches `module` best: the entry itself, or the longest
    entry it lies under. An entry that another entry lies under (`jaxkv`, whose root modules
    and subpackages are layers of their own) names only its own module, so a new root module
    is in no layer until the order lists it."""
    entries = [p for prefixes in layers for p in prefixes]
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            exact_only = any(e != p and _under(e, p) for e in entries)
            if (module == p or (not exact_only and _under(module, p))) and len(p) > best_len:
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
        for d in sorted(graph[name]):
            j = layer_of(d, layers)
            if j is None:
                bad.append(f"{name} (layer {i + 1}) -> {d} (in no layer)")
            elif j < i:
                bad.append(f"{name} (layer {i + 1}) -> {d} (layer {j + 1})")
    return bad


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reach(g: dict, start: str) -> tuple[set, set]:
    """(modules, other packages' names) that importing `start` and calling into it can run:
    every import of each module reached, and the module-level imports of the packages above
    each one (importing a.b.c runs a/__init__.py and a/b/__init__.py)."""
    seen, ext, todo = set(), set(), [(start, "all")]
    while todo:
        module, kind = todo.pop()
        if (module, kind) in seen or module not in g[kind]:
            continue
        seen.add((module, kind))
        ext |= g["ext_" + kind][module]
        todo += [(d, "all") for d in g[kind][module]]
        todo += [(a, "top") for a in _ancestors(module)]
    return {m for m, _ in seen}, ext


def forbidden_reaches(g: dict, rules: dict) -> list[str]:
    bad = []
    for name in sorted(g["all"]):
        for prefix, banned in rules.items():
            if not _under(name, prefix):
                continue
            reached, ext = reach(g, name)
            hits = {m for m in reached for b in banned if _under(m, b)}
            hits |= {f"imports of {e}" for e in ext if e in banned}
            bad += [f"{name} reaches {h}" for h in sorted(hits)]
    return bad


def _doc_layers():
    return layer_order((ROOT / "docs" / "architecture.md").read_text())


def test_no_import_cycles_lazy_imports_included():
    graph = import_graph()["all"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_every_import_goes_down_the_layer_order():
    assert not upward_imports(import_graph()["all"], _doc_layers())


def test_never_reaches_rules_hold_transitively():
    assert not forbidden_reaches(import_graph(), NEVER_REACHES)


def test_the_layer_order_places_every_module():
    graph = import_graph()["all"]
    layers = _doc_layers()
    assert len(layers) >= 10
    assert [m for m in graph if layer_of(m, layers) is None] == []


def _tree(tmp_path, files: dict) -> dict:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return import_graph(tmp_path, ("app",))


def test_the_checks_catch_a_lazy_cycle_and_an_upward_root_import(tmp_path):
    """A made-up tree: a root module imported lazily by a lower package closes a circle, and
    a low layer reaches a high one only through a function-level import."""
    g = _tree(tmp_path, {
        "app/__init__.py": "",
        "app/config.py": "from app.low import helper\n",
        "app/low/__init__.py": "",
        "app/low/helper.py": "def f():\n    from app import config\n",
        "app/low/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from app import config\nimport jax\n"),
    })
    graph = g["all"]
    assert graph["app.low.helper"] == {"app.config"}      # lazy import seen
    assert graph["app.low.typed"] == set()                 # TYPE_CHECKING import left out
    assert find_cycle(graph) in (["app.config", "app.low.helper", "app.config"],
                                 ["app.low.helper", "app.config", "app.low.helper"])
    layers = [("app", "app.config"), ("app.low",)]
    assert upward_imports(graph, layers) == ["app.low.helper (layer 2) -> app.config (layer 1)"]
    assert forbidden_reaches(g, {"app.low": ("jax",)}) == ["app.low.typed reaches imports of jax"]
    assert forbidden_reaches(g, {"app.config": ("app.low.helper",)}) == [
        "app.config reaches app.low.helper"]


def test_the_checks_catch_what_package_inits_run(tmp_path):
    """A cycle through a package's own __init__ (a submodule reading a name of the package that
    imports it), a forbidden package reached only because an __init__ above imports it, and a
    root module that the layer order does not list."""
    g = _tree(tmp_path, {
        "app/__init__.py": "from app import heavy\n",
        "app/heavy.py": "",
        "app/newmod.py": "",
        "app/pkg/__init__.py": "from app.pkg.sub import f\ng = 1\n",
        "app/pkg/sub.py": "from app.pkg import g\ndef f():\n    pass\n",
        "app/core/__init__.py": "",
        "app/core/sched.py": "",
    })
    assert find_cycle(g["all"]) in (["app.pkg", "app.pkg.sub", "app.pkg"],
                                    ["app.pkg.sub", "app.pkg", "app.pkg.sub"])
    assert forbidden_reaches(g, {"app.core": ("app.heavy",)}) == [
        "app.core reaches app.heavy", "app.core.sched reaches app.heavy"]
    layers = [("app", "app.pkg"), ("app.core", "app.heavy")]
    assert layer_of("app.newmod", layers) is None and layer_of("app.pkg.sub", layers) == 0
    assert "app.newmod: in no layer" in upward_imports(g["all"], layers)


def test_host_bookkeeping_loads_no_jax():
    """Importing the scheduler (and with it the whole of jaxkv.core) loads neither JAX nor Flax."""
    import subprocess
    import sys
    code = ("import sys, jaxkv.core.scheduler, jaxkv.core.kv_budget; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.strip()
    assert out == "[]", out
