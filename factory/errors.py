"""The factory's one error policy: an expected failure is a FactoryError with the contract's exit
code (1 a check failed, 2 bad input) and a message the CLI prints as is; anything else is a bug
and shows its traceback."""

from __future__ import annotations


class FactoryError(RuntimeError):
    exit_code = 1


class CheckFailed(FactoryError):
    """A check failed: a build, lint, test gate, push or a part of the stack. Exit 1."""

    exit_code = 1


class InputError(FactoryError):
    """The input is wrong: a spec, pipeline file, flag or missing lock. Exit 2."""

    exit_code = 2
