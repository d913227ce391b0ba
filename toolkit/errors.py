"""Typed errors. Libraries raise these; only the CLI prints them.

Every message is one line a user can act on, showing the numbers involved. Each class
carries the process exit code the command line returns for it; ``EXIT_CODES`` is the one
table of them (the README's table and ``toolkit --help`` are rendered from it).
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class ToolkitError(Exception):
    """Base of every error the toolkit raises on purpose (bad input, not a bug)."""

    exit_code = 1


class SpecError(ToolkitError):
    """The training spec (YAML or Python) is malformed: unknown keys, bad values."""

    exit_code = 2


class InputFileError(ToolkitError):
    """An input file or folder is unreadable or not what it should be (exit 1)."""


class MissingInputError(InputFileError):
    """An input file or folder named on the command line or in a spec does not exist."""

    exit_code = 3


class UnknownNameError(SpecError):
    """A registry name (model, GPU) that does not exist."""


class ConversionSetupError(ToolkitError):
    """A request that cannot be carried out as asked (bad dtype name, no args and no --hf-config)."""

    exit_code = 2


class UnsupportedModelError(ConversionSetupError):
    """A supported architecture with settings megatron-core would compute differently
    (e.g. DeepSeek-V2's group-limited routing by group maximum): refused, with the numbers."""


class PlanError(ToolkitError):
    """The layout violates one or more rules; ``errors`` lists every one of them."""

    exit_code = 2

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__(f"{len(self.errors)} rule(s) violated: " + "; ".join(self.errors))


class OutputExistsError(ToolkitError):
    """Refusing to overwrite existing data without being asked."""


EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "failure while working: unreadable or inconsistent input data, output exists without --overwrite, "
       "a check that failed (verify), any other error",
    2: "invalid input: usage (missing or unknown option or argument, bad value, unknown command), "
       "spec (unknown key, bad value) or layout (rule violated); nothing is written",
    3: "an input file or folder does not exist",
    4: "preempted: SIGTERM or SIGUSR1 stopped a training run after its step, which it saved; the same "
       "command with --resume continues it",
    5: "a training step's loss or gradient norm was NaN or Inf (train.on_nan: stop); the line names the step "
       "and the rank",
    130: "interrupted (Ctrl-C)",
}


def exit_code_help() -> str:
    """The exit-code table as one line for ``--help``."""
    return "Exit codes: " + "; ".join(f"{code} {text.split(':')[0]}" for code, text in EXIT_CODES.items()) + "."


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The valid name closest to a misspelled one, or None when nothing is close."""
    choices = list(choices)
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    if match:
        return match[0]
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.4)
    return lowered[match[0]] if match else None


def unknown_key_message(key: str, valid: Iterable[str], where: str = "") -> str:
    """`unknown key 'parallel.tpp' (did you mean 'tp'?)`, the closest valid key named."""
    valid = sorted(valid)
    hint = closest(key, valid)
    place = f"{where}." if where else ""
    suggestion = f" (did you mean '{hint}'?)" if hint else f" (valid: {', '.join(valid)})"
    return f"unknown key '{place}{key}'{suggestion}"
