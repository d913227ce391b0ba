"""Command line: thin wrappers that parse, call one library function, and print.

Exit codes are documented once, in ``toolkit.errors.EXIT_CODES`` (and the README's table).
Usage errors (missing or unknown option, missing argument, bad value, unknown command) are one
line and exit 2: typer runs outside its standalone mode, so whichever click it carries
(``click`` or its vendored ``typer._click``) raises them here (``main``).
"""
from __future__ import annotations

import os
import sys

# The command line's processes use no pydantic plugin; pydantic would otherwise scan every
# installed package's entry points for one when the spec models are built (tens of ms of each
# command's start-up). A value the user set is kept.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

from typing import Annotated  # noqa: E402

import typer  # noqa: E402

from ..errors import ToolkitError, exit_code_help  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, configure, convert and run DeepSpeed + Megatron-core training from one spec.",
                  epilog=exit_code_help())
VERSIONS_OF = ("torch", "deepspeed", "megatron-core", "transformers")  # what a bug report needs besides ours


def version_line() -> str:
    """`ds-megatron-toolkit 0.1.0 (torch ..., deepspeed ..., ...)` from the installed metadata
    (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"ds-megatron-toolkit {of('ds-megatron-toolkit')} (" + ", ".join(f"{n} {of(n)}" for n in VERSIONS_OF) + ")"


def _print_version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                   help="print the versions of the toolkit and its libraries")] = False,
             verbose: Annotated[bool, typer.Option("--verbose", help="also print what megatron-core, DeepSpeed and "
                                                   "transformers say about themselves (or set TOOLKIT_VERBOSE=1)")
                                ] = False) -> None:
    """Plan, configure, convert and run DeepSpeed + Megatron-core training from one spec."""
    from ..quiet import quiet_imports, set_verbose

    set_verbose(verbose)
    quiet_imports()


def _register(argv: list[str] | None = None) -> None:
    """Import the command modules (their commands register on `app`). ``toolkit convert ...``
    needs only its own: the others import pydantic's spec models and rich, ~0.12 CPU s of a
    conversion's start-up (issue 44); any other command line (help, a typo) gets them all."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["convert"]:
        from . import convert  # noqa: F401
        return
    from . import convert, data, models, plan, report, status  # noqa: F401, F811


def _exit_status(code: object) -> int:
    """SystemExit's code as a process status (None is success; a message is a failure)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _usage_error(e: BaseException) -> bool:
    """A click usage error (a missing argument, an unknown option or command, a bad value), of
    click itself or of the copy recent typer releases vendor (``typer._click``)."""
    return any(c.__name__ == "UsageError" for c in type(e).__mro__)


def usage_line(e: BaseException) -> str | None:
    """The one line a usage error prints (None: click printed the help already, as for a
    command group given no command)."""
    message = e.format_message()
    if not message:
        return None
    ctx = getattr(e, "ctx", None)
    where = f" (`{ctx.command_path} --help` shows the usage)" if ctx is not None else ""
    message = message[0].lower() + message[1:]
    return f"error: {message.removesuffix('.') if where else message}{where}"


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C (SIGINT) or SIGTERM ends any command with one line and exit 128 + signal
    (click would print "Aborted!" and exit 1); a usage error is one line and exit 2 (click
    would print its usage and an error box)."""
    from ..atomic import Interrupted, signals_raise

    _register(argv)
    try:
        with signals_raise():
            code = app(args=argv, standalone_mode=False, prog_name="toolkit")
    except SystemExit as e:
        return _exit_status(e.code)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if not _usage_error(e):
            raise
        line = usage_line(e)
        if line is not None:
            print(line, file=sys.stderr)
        return e.exit_code
    return code if isinstance(code, int) else 0  # click returns an Exit's code when not standalone


def run() -> None:
    import gc

    code = main()
    # The interpreter's last collection at exit walks every object the imports made (torch's:
    # 0.6 s of a conversion's start-up cost here); frozen ones are left to the exit itself.
    gc.freeze()
    sys.exit(code)
