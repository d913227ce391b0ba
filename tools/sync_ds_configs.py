"""Regenerate ds_configs/ from the shipped examples (examples/*.yaml) and recipes
(recipes/*.py exposing make_spec()): `python tools/sync_ds_configs.py [--check]`.

--check exits 1 and names every file that differs, is missing or is stale.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.emit.deepspeed import deepspeed_config  # noqa: E402
from toolkit.plan import make_plan  # noqa: E402
from toolkit.spec import TrainingSpec  # noqa: E402


def shipped_specs() -> dict[str, TrainingSpec]:
    specs = {f"example_{p.stem}": TrainingSpec.from_yaml(p) for p in sorted((ROOT / "examples").glob("*.yaml"))}
    for p in sorted((ROOT / "recipes").glob("*.py")):
        mod_spec = importlib.util.spec_from_file_location(f"_recipe_{p.stem}", p)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        if hasattr(mod, "make_spec"):
            specs[f"recipe_{p.stem}"] = mod.make_spec()
    return specs


def render(spec: TrainingSpec) -> str:
    return json.dumps(deepspeed_config(make_plan(spec).require_valid()), indent=2) + "\n"


def differences() -> dict[str, str]:
    """file name -> expected content (None: stale file to delete) for every out-of-date file."""
    want = {f"{name}.json": render(spec) for name, spec in shipped_specs().items()}
    have = {p.name: p.read_text() for p in (ROOT / "ds_configs").glob("*.json")}
    diff: dict[str, str | None] = {n: t for n, t in want.items() if have.get(n) != t}
    diff.update({n: None for n in have if n not in want})
    return diff


def main(argv: list[str]) -> int:
    diff = differences()
    if "--check" in argv:
        for name, text in diff.items():
            print(f"ds_configs/{name}: {'stale' if text is None else 'out of date'}")
        return 1 if diff else 0
    for name, text in diff.items():
        path = ROOT / "ds_configs" / name
        if text is None:
            path.unlink()
        else:
            path.write_text(text)
        print(f"{'removed' if text is None else 'wrote'} {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
