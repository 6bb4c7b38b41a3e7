"""docs/architecture.md matches the tree: every package it names exists, and every package in
the tree is named in its package index."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tree_packages():
    out = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and not any(p.startswith(".") or p in ("build", "node_modules") for p in rel.parts):
            out.add(".".join(rel.parts))
    return out


def test_architecture_doc_names_exactly_the_packages_of_the_tree():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    index = doc[doc.index("## Package index"):]
    named = set(re.findall(r"`((?:jaxkv|pallas_kernels|serve|benchmarks|tests)(?:\.[a-z_]+)*)`", index))
    packages = tree_packages()
    assert named - packages == set(), "named but missing from the tree"
    assert packages - named == set(), "in the tree but not named in docs/architecture.md"
    for path in re.findall(r"`((?:jaxkv|pallas_kernels|serve)/[a-z_/]+\.py)`", doc):
        assert (ROOT / path).is_file(), path
