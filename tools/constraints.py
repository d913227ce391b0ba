"""The versions the suite was last tested with, and what a fresh install would change.

    python tools/constraints.py write      # constraints.txt <- this environment (after a green `make test`)
    python tools/constraints.py diff       # this environment against constraints.txt (what `make test-latest` reports)

`make install` / `make test` install with `-c constraints.txt`, so a fresh clone gets the
versions that passed here, whatever PyPI released since; `make test-latest` installs the
newest releases into .venv-latest, prints what moved, and runs the suite there. The file
pins every distribution of the environment except the project itself and the installer's
own tools (pip, setuptools, wheel); local version labels are dropped (`torch==2.13.0`
admits the local CPU build `2.13.0+cpu`; the DeepSpeed wheel with compiled CPU ops,
tools/build_ds_ops.py, keeps its version).
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

FILE = Path(__file__).resolve().parents[1] / "constraints.txt"
PROJECT = "ds-megatron-toolkit"
INSTALLER = {"pip", "setuptools", "wheel"}
HEADER = ("# The versions `make test` last passed with (tools/constraints.py write); `make install` / `make test`\n"
          "# install with -c constraints.txt. `make test-latest` tries the newest releases and reports what changed.\n")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """{canonical name: public version} of this environment's distributions."""
    out = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name and name != PROJECT and name not in INSTALLER:
            out[name] = dist.version.split("+")[0]
    return out


def pinned(path: Path = FILE) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per distribution whose version differs, sorted by name."""
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a != b:
            lines.append(f"{name}: {a or '(absent)'} -> {b or '(absent)'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["write", "diff"])
    args = p.parse_args(argv)
    now = installed()
    if args.action == "write":
        FILE.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(now.items())))
        print(f"wrote {len(now)} pins to {FILE.name}")
        return 0
    moved = changes(pinned(), now)
    print(f"{len(moved)} distributions differ from {FILE.name}" + (":" if moved else " (the tested versions)"))
    print("\n".join(f"  {line}" for line in moved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
