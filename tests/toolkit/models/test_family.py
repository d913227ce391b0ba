"""A model family is one file (toolkit/models/families/<family>.py) plus registry data: its HF
config <-> shape mapping, weight table, aliases, refusals, Megatron-LM signature and tiny
flavours are registered there once, and every other part reads the shape's fields. This holds
the house to it: no source file outside the family files names an architecture, and every
family registers what the rest of the toolkit asks of it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from toolkit.models import load_model, named_models
from toolkit.models.family import architecture_from_megatron, families, supported, table_for

from tests.conftest import ROOT

FAMILY_FILES = ROOT / "toolkit" / "models" / "families"
SOURCES = ("toolkit", "converters", "recipes")


def architecture_names() -> set[str]:
    return {arch for fam in families() for arch in fam.architectures}


def test_no_source_outside_the_family_files_names_an_architecture():
    """String constants only (docstrings and comments may give examples)."""
    archs, found = architecture_names(), []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if FAMILY_FILES in path.parents:
                continue
            tree = ast.parse(path.read_text())
            docs = {id(n.body[0].value) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                    and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            found += [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value}" for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                      and any(a in n.value for a in archs)]
    assert not found, "architectures named outside toolkit/models/families/:\n" + "\n".join(found)


@pytest.mark.parametrize("family", [f.name for f in families()])
def test_every_family_registers_what_the_toolkit_reads(family):
    fam = next(f for f in families() if f.name == family)
    assert fam.tiny, f"{family} has no tiny flavour"
    for name, cfg in fam.tiny.items():
        shape = load_model(name)
        assert named_models()[name]["config"] == cfg and shape.architecture in fam.architectures
        assert shape.architecture in supported() and table_for(shape), name
        assert fam.to_hf(shape)["architectures"] == [shape.architecture]


def test_megatron_signatures_name_one_architecture_each():
    """A Megatron-LM checkpoint without its HF config is read by the one family whose signature
    its flags are (converters.megatron_args.megatron_features)."""
    sigs = [(f.architectures[0], tuple(sorted(f.megatron_signature.items()))) for f in families()
            if f.megatron_signature is not None]
    assert len({s for _, s in sigs}) == len(sigs), sigs
    for arch, sig in sigs:
        assert architecture_from_megatron(dict(sig)) == arch
    assert architecture_from_megatron({"mla": True, "moe": True, "shared_expert": True, "qk_norm": True,
                                       "qkv_bias": False}) is None


def test_a_family_file_is_its_own_module():
    """Family files import only the models floor (shape, weights, family registry, _common)."""
    allowed = {"toolkit.models.shape", "toolkit.models.weights", "toolkit.models.family",
               "toolkit.models.families._common", "toolkit.errors", "__future__"}
    for path in sorted(FAMILY_FILES.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = "toolkit.models.families".split(".")[:4 - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
                assert mod in allowed, f"{path.name} imports {mod}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert all(n in allowed or "." not in n and n in {"re", "typing"} for n in names), (path.name, names)


def test_the_tiny_flavours_are_family_data_not_registry_data():
    registry = (ROOT / "toolkit" / "models" / "registry.json").read_text()
    assert "-tiny" not in registry
    assert Path(FAMILY_FILES / "__init__.py").is_file()
