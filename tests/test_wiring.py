"""Objects are wired when they are built, read off the source of jaxkv/ and serve/.

- A collaborator (the runner's KV offload, multi-process leader, programs and sampler; the
  scheduler's structured-output manager; the compiler's background thread) is set by its
  owner's constructor: no module assigns one to another object (`runner.leader = ...`).
- A private attribute (`x._name`) of another object is touched only in the file whose class
  defines it (`self._name = ...` there): no module reads or writes another module's privates,
  such as per-request data hung on the user's SamplingParams.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLLABORATORS = {"leader", "offload", "programs", "sampler", "structured_output_manager",
                 "background", "kv_offload", "compiler"}


def _files(root: pathlib.Path):
    for pkg in ("jaxkv", "serve"):
        yield from sorted((root / pkg).rglob("*.py"))


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def collaborators_set_from_outside(root: pathlib.Path = ROOT) -> list[str]:
    """'file:line: x.attr' for each assignment (=) of a collaborator attribute to an object
    that is not the assigning method's own; an updated count (x.programs += 1) is no wiring."""
    bad = []
    for f in _files(root):
        for node in ast.walk(ast.parse(f.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.For)) else [])  # += counts
            for t in (x for target in targets for x in ast.walk(target)):  # tuples too
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) \
                        and t.attr in COLLABORATORS and not _on_self(t):
                    bad.append(f"{f.relative_to(root)}:{node.lineno}: {ast.unparse(t)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLABORATORS
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
                bad.append(f"{f.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return bad


def foreign_privates(root: pathlib.Path = ROOT) -> list[str]:
    """'file:line: x._name' for each use of another object's private attribute that the file
    does not define on its own instances (self._name = ...)."""
    bad = []
    for f in _files(root):
        tree = ast.parse(f.read_text())
        own = {n.attr for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _on_self(n)}
        own |= {n.name for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}  # private methods
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") \
                    and not n.attr.startswith("__") and not _on_self(n) and n.attr not in own:
                if isinstance(n.value, ast.Name) and n.value.id.startswith("_"):
                    continue  # a module-level private object of this file (threading.local)
                bad.append(f"{f.relative_to(root)}:{n.lineno}: {ast.unparse(n)}")
            elif _private_by_name(n, own):
                bad.append(f"{f.relative_to(root)}:{n.lineno}: {ast.unparse(n)}")
    return bad


def _private_by_name(n: ast.AST, own: set[str]) -> bool:
    """getattr/setattr/hasattr(x, "_name", ...) on another object."""
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "setattr", "hasattr") and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
            and n.args[1].value.startswith("_") and not n.args[1].value.startswith("__")
            and n.args[1].value not in own
            and not (isinstance(n.args[0], ast.Name) and n.args[0].id in ("self", "cls")))


def test_no_collaborator_is_set_from_outside_its_owner():
    assert collaborators_set_from_outside() == []


def test_no_module_touches_another_modules_privates():
    assert foreign_privates() == []


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in {"jaxkv/__init__.py": "", "serve/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_checks_catch_late_wiring_and_foreign_privates(tmp_path):
    root = _tree(tmp_path, {
        "jaxkv/setup.py": ("def build(runner, leader):\n    runner.leader = leader\n"
                           "    runner.counter.programs += 1\n"
                           "    runner.sampler, n = leader, 1\n"
                           "    setattr(runner, 'offload', None)\n"),
        "jaxkv/engine.py": ("def add(params, ids):\n    params._bad_words_token_ids = ids\n"
                            "    return getattr(params, 'x', None) or params._grammar\n"
                            "def read(p):\n    return getattr(p, '_grammar', None)\n"),
        "jaxkv/ok.py": ("class A:\n    def __init__(self, leader):\n        self.leader = leader\n"
                        "        self._n = 0\n    def peer(self, other):\n        return other._n\n"),
    })
    assert sorted(collaborators_set_from_outside(root)) == [
        "jaxkv/setup.py:2: runner.leader", "jaxkv/setup.py:4: runner.sampler",
        "jaxkv/setup.py:5: setattr(runner, 'offload', None)"]
    assert sorted(foreign_privates(root)) == ["jaxkv/engine.py:2: params._bad_words_token_ids",
                                      "jaxkv/engine.py:3: params._grammar",
                                      "jaxkv/engine.py:5: getattr(p, '_grammar', None)"]
