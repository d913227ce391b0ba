"""Command line: thin wrappers that parse, call one library function, and print.

Exit codes: 0 success, 2 invalid input (spec/layout/usage), 1 any other failure.
"""
from __future__ import annotations

import sys

import click
import typer

from ..errors import ToolkitError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, configure, convert and run DeepSpeed + Megatron-core training from one spec.")


def _register() -> None:
    from . import plan  # noqa: F401  (commands register on `app`)

    for name in ("convert", "data", "hf"):
        try:
            __import__(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise


def main(argv: list[str] | None = None) -> int:
    _register()
    try:
        code = app(args=argv, standalone_mode=False, prog_name="toolkit")
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return 2
    except click.exceptions.Abort:
        print("aborted", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


def run() -> None:
    sys.exit(main())
