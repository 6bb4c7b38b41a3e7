"""Every third-party module that the tree imports is declared in pyproject.toml for its folder.

A package that the machine happens to carry (jsonschema in the system Python, say) makes a green
run on that machine and a collection error in a user's fresh virtual environment. This test reads
every import under jaxkv/, serve/, pallas_kernels/, tests/ and benchmarks/ (nested ones, and the
literal names given to `pytest.importorskip`, `importlib.import_module` and
`importlib.util.find_spec`, which a missing package turns into a skip or a silent fallback) and
fails, naming the file, line and module, when one is neither the standard library, the project
itself, nor declared for that folder: `dependencies` for the package folders, plus the `dev`
extra for tests/ and the `bench` and `llamacpp` extras for benchmarks/ (issue 34).
"""
import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"jaxkv", "serve", "pallas_kernels", "tests", "benchmarks"}
# folder -> the extras it may use besides the runtime dependencies
FOLDER_EXTRAS = {"jaxkv": (), "serve": (), "pallas_kernels": (), "tests": ("dev",),
                 "benchmarks": ("bench", "llamacpp")}
# import name -> distribution name, where they differ by more than case and '-' / '_' / '.'
DISTRIBUTION = {"yaml": "pyyaml", "orbax": "orbax-checkpoint", "llama_cpp": "llama-cpp-python",
                "agents": "openai-agents"}
# calls whose first argument, a literal, names a module to import
IMPORTING_CALLS = {"importorskip", "import_module", "find_spec"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """'torch==2.13.0' -> 'torch'; 'jax[cuda12]>=0.10' -> 'jax'; markers and extras dropped."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match, f"pyproject.toml: unreadable requirement {spec!r}"
    return normalize(match.group(1))


def declared(pyproject: dict, folder: str) -> set[str]:
    """The normalized distribution names that `folder` may import: the runtime dependencies plus
    the folder's extras and the packages that the Makefile installs with --no-deps. Raises KeyError for a folder or an extra the table does not know."""
    project = pyproject["project"]
    specs = list(project["dependencies"])
    for extra in FOLDER_EXTRAS[folder]:
        specs += project["optional-dependencies"][extra]
    specs += pyproject["tool"]["jaxkv"]["no-deps"]
    return {requirement_name(s) for s in specs}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) for each absolute import in `source`, at any depth, and for each
    literal module name passed to one of IMPORTING_CALLS. Relative imports are left out."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in IMPORTING_CALLS and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def is_local(top: str, path: Path) -> bool:
    """The project's own packages, and a sibling module of a script run from its folder
    (benchmarks/serving.py imports `common` from benchmarks/). Inside a package (a folder with
    __init__.py) an absolute import never means a sibling: jaxkv/loader/gguf.py's
    `from gguf import ...` is the gguf distribution."""
    here = path.parent
    if top in PROJECT:
        return True
    if (here / "__init__.py").exists() and here != ROOT / "benchmarks":  # scripts run from there
        return False
    return (here / f"{top}.py").exists() or (here / top / "__init__.py").exists()


def undeclared(folder: str, allowed: set[str]) -> list[str]:
    """'path:line imports module' for each import under `folder` that is neither the standard
    library, the project, nor a distribution in `allowed` (normalized names)."""
    problems = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module in imported_modules(path.read_text()):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or is_local(top, path):
                continue
            if normalize(DISTRIBUTION.get(top, top)) not in allowed:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return problems


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("folder", sorted(FOLDER_EXTRAS))
def test_every_import_is_declared(pyproject, folder):
    allowed = declared(pyproject, folder)
    extras = " + ".join(("dependencies",) + FOLDER_EXTRAS[folder])
    problems = undeclared(folder, allowed)
    assert not problems, (f"not declared in pyproject.toml for {folder}/ ({extras}):\n  "
                          + "\n  ".join(problems))


def test_no_deps_packages_are_installed_by_every_install_target(pyproject):
    """[tool.jaxkv] no-deps lists what pip cannot be given as a dependency; the Makefile's
    install targets are what install it."""
    makefile = (ROOT / "Makefile").read_text()
    targets = re.findall(r"^(install[\w-]*):.*\n((?:\t.*\n)+)", makefile, re.M)
    assert {name for name, _ in targets} >= {"install", "install-dev", "install-bench"}
    for name, recipe in targets:
        for package in pyproject["tool"]["jaxkv"]["no-deps"]:
            assert f"--no-deps {package}" in recipe, f"make {name} does not install {package}"


def test_a_removed_declaration_is_named(pyproject):
    """The check is live: without jsonschema in the dev extra, both structured-output test files
    are named, at their import line."""
    allowed = declared(pyproject, "tests") - {"jsonschema"}
    problems = undeclared("tests", allowed)
    assert "tests/engine/test_structured_outputs.py:8 imports jsonschema" in problems
    assert any(p.startswith("tests/serve/test_structured_outputs.py:") for p in problems)
    assert all(p.endswith("imports jsonschema") for p in problems)


def test_a_third_party_import_named_like_its_file_is_checked(pyproject):
    """jaxkv/loader/gguf.py imports the gguf distribution: without it in dependencies, both
    that file and the tokenizer's are named."""
    problems = undeclared("jaxkv", declared(pyproject, "jaxkv") - {"gguf"})
    assert any(p.startswith("jaxkv/loader/gguf.py:") for p in problems)
    assert any(p.startswith("jaxkv/loader/gguf_tokenizer.py:") for p in problems)


def test_the_reader_sees_nested_and_skipped_imports(tmp_path):
    source = ("import os, numpy.linalg\nfrom . import x\nfrom jax import numpy\n"
              "def f():\n    import torch\n    pytest.importorskip('accelerate')\n"
              "    importlib.util.find_spec('llama_cpp')\n    importlib.import_module(name)\n")
    assert sorted(imported_modules(source)) == [(1, "numpy.linalg"), (1, "os"), (3, "jax"),
                                                (5, "torch"), (6, "accelerate"), (7, "llama_cpp")]
    assert requirement_name("jax[cuda12]>=0.10.2,<0.12") == "jax"
    assert requirement_name("tomli; python_version < '3.11'") == "tomli"
    assert normalize(DISTRIBUTION["yaml"]) == "pyyaml" and normalize("ml_dtypes") == "ml-dtypes"
