"""One error type for bad input, the checks that raise it, and the CLI wrapper that turns
it into one line.

Every check in the simulator raises :class:`ConfigError` with a message that names the
offending field, the value and the range it must lie in, so that a command-line user
sees ``error: budget: got 16, must be >= 32 (the running decodes)`` and exit code 2
instead of a traceback.

Numbers are checked against ranges written down once here:

=====================  =================================  ====================================
quantity               range                              why
=====================  =================================  ====================================
token counts           integers in [1, ``MAX_TOKENS``]    a request's or a pass's tokens are
(prompt, output,                                          positions in a sequence, which
context, budget)                                          engines hold in int32 (vLLM's
                                                          ``positions``); sums of them stay
                                                          far inside int64
other integers         within int64                       numpy's and the files' width
reals                  finite, with a field's own bounds  NaN and inf are never a setting
booleans               never where a number belongs       ``true`` is not 1
=====================  =================================  ====================================
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import signal
import sys
import threading
from typing import Callable

INT64_MAX = 2**63 - 1
MAX_TOKENS = 2**31 - 1
"""Largest token count of one request or one pass (int32, as engines hold positions)."""


class ConfigError(ValueError):
    """Bad input: the message names the field and the allowed range."""


def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so that a 400-digit number or a 200 KB
    string stays one short line (Python refuses to print ints of over 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:max(limit - 24, 8)]}... ({len(text)} chars)"


def require(condition: bool, field: str, value: object, allowed: str) -> None:
    """Raise ConfigError(``field: got value, allowed``) unless ``condition``."""
    if not condition:
        raise ConfigError(f"{field}: got {show(value)}, {allowed}")


def did_you_mean(word: str, known) -> str:
    """``"did you mean X? "`` for the known name nearest a mistyped ``word``, or ``""``
    when none is near (difflib's ratio of 0.6: one or two letters off in a short name)."""
    near = difflib.get_close_matches(str(word), [str(k) for k in known], n=1, cutoff=0.6)
    return f"did you mean {near[0]}? " if near else ""


def _bound(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _is_real(value: object) -> bool:
    """A finite int or float (numpy's too), never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def number(field: str, value: float, low: float | None = None, high: float | None = None, *,
           low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float within the bounds (``low_open``: strictly above ``low``);
    booleans, NaN, inf and ints beyond a float's range are refused."""
    ok = _is_real(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        parts = []
        if low is not None:
            parts.append(f"{'>' if low_open else '>='} {_bound(low)}")
        if high is not None:
            parts.append(f"{'<' if high_open else '<='} {_bound(high)}")
        raise ConfigError(f"{field}: got {show(value)}, must be a finite number"
                          + (" " + " and ".join(parts) if parts else ""))
    return float(value)


def integer(field: str, value: int, low: int = 0, high: int = INT64_MAX, why: str = "") -> int:
    """``value`` as an int in [low, high] (numpy integers accepted, booleans and floats not)."""
    ok = (isinstance(value, numbers.Integral) and not isinstance(value, bool)
          and low <= int(value) <= high)
    if not ok:
        allowed = f"must be an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(f"{field}: got {show(value)}, {allowed}" + (f" ({why})" if why else ""))
    return int(value)


def tokens(field: str, value: int, low: int = 1) -> int:
    """A token count: an integer in [low, MAX_TOKENS]."""
    return integer(field, value, low, MAX_TOKENS)


def positive(field: str, value: float, high: float | None = None) -> float:
    return number(field, value, 0, high, low_open=True)


MAX_SLO_TTFT_S = 600.0
"""The largest TTFT target taken, seconds: ten minutes (a batch job's is not a latency SLO)."""
MAX_SLO_ITL_S = 10.0
"""The largest ITL target taken, seconds: a gap of 10 s between two tokens is no stream."""


def slo_seconds(field: str, value: float, high: float) -> float:
    """A latency target in seconds, in (0, ``high``]; refused with a hint at the unit,
    since a target given in milliseconds (``100`` for 100 ms) is a plausible number too."""
    if _is_real(value) and value > high:
        raise ConfigError(f"{field}: got {show(value)}, must be at most {_bound(high)} seconds; "
                          f"targets are in seconds (100 ms is 0.1)")
    return positive(field, value)


def non_negative(field: str, value: float, high: float | None = None) -> float:
    return number(field, value, 0, high)


def fraction(field: str, value: float) -> None:
    require(_is_real(value) and 0 < value <= 1, field, value, "must lie in (0, 1]")


class Terminated(BaseException):
    """SIGTERM, raised where the command is (as Ctrl-C raises KeyboardInterrupt), so that it
    ends with one line and exit 143 instead of a stack dump."""


def _terminate(signum, frame) -> None:
    raise Terminated


def catch_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` (in the main thread, and unless the process
    was started with it ignored). Ray's driver takes SIGTERM over in ``ray.init`` (a native
    stack dump, then exit), so a local Ray instance's start calls this again."""
    if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN):
        signal.signal(signal.SIGTERM, _terminate)


def exit_on_the_next_signal() -> None:
    """After a first Ctrl-C or SIGTERM: a second one while the command cleans up (Ray's
    shutdown, the progress bars) ends the process at once, without a traceback."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: os._exit(128 + signum))


def cli_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI ``main`` in this process and return its exit code: bad input prints one
    line (``error: field: got ..., allowed ...``) and returns 2; ``--help`` returns 0; a
    Ctrl-C prints "interrupted" and returns 130, a SIGTERM "terminated" and 143."""
    catch_sigterm()
    try:
        code = main(argv)
        if code in (130, 143):  # stopped by a signal it handled itself (train.py's checkpoint)
            exit_on_the_next_signal()
        return code
    except ConfigError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stop:
        return stopped(stop)
    except SystemError as err:
        # A signal raised inside Ray's native wait comes out as a SystemError caused by it.
        stop = err.__cause__ or err.__context__
        if not isinstance(stop, (KeyboardInterrupt, Terminated)):
            raise
        return stopped(stop)
    except SystemExit as exit_:  # argparse's --help
        return exit_.code if isinstance(exit_.code, int) else 0


def stopped(stop: BaseException) -> int:
    """One line and the exit code of a command stopped by Ctrl-C or SIGTERM."""
    exit_on_the_next_signal()
    term = isinstance(stop, Terminated)
    print("terminated" if term else "interrupted", file=sys.stderr)
    return 143 if term else 130


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run a CLI ``main`` and exit with its code (see :func:`cli_main`)."""
    sys.exit(cli_main(main, argv))
