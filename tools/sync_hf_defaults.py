"""Regenerate toolkit/models/hf_defaults.json from the installed transformers:
`python tools/sync_hf_defaults.py [--check]`.

For each supported family (its model_type), the config class's field defaults, attribute
aliases and default rope base: what transformers fills in when a config.json leaves a key
out. toolkit.models.hf_json reads config.json with these, so planning never imports
transformers (or torch). --check exits 1 when the file differs from what would be written.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolkit.models.hf_json import DEFAULTS_FILE  # noqa: E402
from toolkit.models.family import families  # noqa: E402

SKIPPED = {"rope_parameters"}  # normalised by hf_json.rope_parameters, as transformers does


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _json_value(value) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return value is not dataclasses.MISSING


def class_defaults(model_type: str) -> dict:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = {f.name: _default(f) for f in dataclasses.fields(cls) if f.name not in SKIPPED}
    theta = cls.default_theta  # Gemma 3: one per attention kind ({"global": ..., "local": ...})
    theta = {k: float(v) for k, v in theta.items()} if isinstance(theta, dict) else float(theta)
    return {"config_class": cls.__name__, "default_theta": theta,
            "aliases": dict(getattr(cls, "attribute_map", {}) or {}),
            "defaults": {k: v for k, v in sorted(fields.items()) if _json_value(v)}}


def render() -> str:
    types = sorted({fam.name for fam in families()})
    return json.dumps({t: class_defaults(t) for t in types}, indent=1) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        stale = not DEFAULTS_FILE.is_file() or DEFAULTS_FILE.read_text() != text
        if stale:
            print(f"{DEFAULTS_FILE.relative_to(ROOT)} is out of date: run `python tools/sync_hf_defaults.py`")
        return 1 if stale else 0
    DEFAULTS_FILE.write_text(text)
    print(f"wrote {DEFAULTS_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
