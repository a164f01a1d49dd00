"""One error type for bad input, and the CLI wrapper that turns it into one line.

Every check in the simulator raises :class:`ConfigError` with a message that
names the offending field and the range it must lie in, so that a command-line
user sees ``error: budget: got 16, must be >= 32 (the running decodes)`` and
exit code 2 instead of a traceback.
"""

from __future__ import annotations

import math
import sys
from typing import Callable


class ConfigError(ValueError):
    """Bad input: the message names the field and the allowed range."""


def require(condition: bool, field: str, value: object, allowed: str) -> None:
    """Raise ConfigError(``field: got value, allowed``) unless ``condition``."""
    if not condition:
        raise ConfigError(f"{field}: got {value!r}, {allowed}")


def positive(field: str, value: float) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
            field, value, "must be a finite number > 0")


def non_negative(field: str, value: float) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
            field, value, "must be a finite number >= 0")


def fraction(field: str, value: float) -> None:
    require(isinstance(value, (int, float)) and 0 < value <= 1, field, value,
            "must lie in (0, 1]")


def positive_int(field: str, value: int) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
            field, value, "must be an integer > 0")


def cli_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI ``main`` in this process and return its exit code: bad input prints one
    line (``error: field: got ..., allowed ...``) and returns 2; ``--help`` returns 0."""
    try:
        return main(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as exit_:  # argparse's --help
        return exit_.code if isinstance(exit_.code, int) else 0


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run a CLI ``main`` and exit with its code (see :func:`cli_main`)."""
    sys.exit(cli_main(main, argv))
