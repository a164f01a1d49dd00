"""Command lines generated from configuration dataclasses.

Each entry point has one ``@dataclass`` whose fields carry a docstring right under
them (the CleanRL/tyro convention); :func:`parse` turns it into an argparse CLI
where ``field_name`` becomes ``--field-name`` and the docstring becomes its help.
Standard library only, so the simulator's CLIs stay light.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import types
import typing
from functools import lru_cache
from typing import Any, TypeVar

from envs.errors import ConfigError, show

T = TypeVar("T")


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written under it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def _integer(text: str) -> int:
    """argparse's ``int`` with the project's message (the range is the field's own check)."""
    try:
        return int(text)
    except ValueError:  # not an integer, or one of over 4,300 digits

        raise argparse.ArgumentTypeError(f"got {show(text)}, must be an integer") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {show(text)}, must be a number") from None


_integer.__name__, _real.__name__ = "int", "float"
CONVERTERS = {int: _integer, float: _real, str: str}


def _none_or(conv):
    def parse(text: str):
        return None if text.lower() == "none" else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag per init field of the dataclass ``cls``, its help from the field's docstring.
    Fields named in ``cls.CLI_REFUSED`` (inherited ones a command does not use) still parse,
    so that the command can refuse them in one line, but ``--help`` leaves them out."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    refused = set(getattr(cls, "CLI_REFUSED", ()))
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        tp, optional = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        hide = f.name in refused
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=argparse.SUPPRESS if hide else help_text)
            continue
        if typing.get_origin(tp) is tuple:  # several values, the flag repeatable: --x A B --x C
            parser.add_argument(flag, dest=f.name, action="extend", nargs="+", default=None,
                                metavar=f.name.upper(),
                                help=argparse.SUPPRESS if hide else help_text if "(default:" in help_text
                                else f"{help_text} (default: none)")
            continue
        conv = CONVERTERS.get(tp, str)
        kwargs: dict[str, Any] = dict(
            dest=f.name, default=default, metavar=f.name.upper(),
            type=_none_or(conv) if optional else conv,
            help=argparse.SUPPRESS if hide else help_text if "(default:" in help_text
            else f"{help_text} (default: {default})")
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors in the project's one-line form (``error: field: ...``, exit 2)
    instead of a usage block: ``argument --num-requests: ...`` names the field as every
    other check does, ``num_requests: ...``. Flags are taken whole, never abbreviated:
    ``suite --seed 3`` would otherwise run 3 streams as ``--seeds 3``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        m = re.match(r"argument (--[\w-]+)(?:/[^:]*)?: (.*)", message, re.S)
        if m:
            message = f"{m[1][2:].replace('-', '_')}: {m[2]}"
        elif message.startswith("unrecognized arguments:"):
            message += self.close_flag(message.split(":", 1)[1].split())
        raise ConfigError(f"{message} (see {self.prog} --help)")


    def close_flag(self, words: list[str]) -> str:
        """``; did you mean --seeds?`` for the first unknown flag near a shown one."""
        near = close_flags(words, [s for a in self._actions if a.help != argparse.SUPPRESS
                                   for s in a.option_strings])
        return f"; did you mean {near}?" if near else ""


def close_flags(words: list[str], flags: list[str]) -> str:
    """The shown flags the first unknown ``--flag`` in ``words`` begins (up to three, as it
    was an abbreviation of them: ``--load`` -> ``--load-low or --load-high``), else the
    nearest by spelling; '' where none is near."""
    flags = [f for f in flags if f.startswith("--")]
    for w in words:
        if not w.startswith("--"):
            continue
        w = w.split("=")[0]
        begun = [f for f in flags if f.startswith(w)]
        if 0 < len(begun) <= 3:
            return " or ".join(begun)
        spelt = difflib.get_close_matches(w, flags, n=1, cutoff=0.75)
        if spelt:
            return spelt[0]
    return ""


def given_fields(cls: type, argv: list[str] | None = None) -> set[str]:
    """The fields of ``cls`` that ``argv`` sets (by flag), whatever their values: a flag
    given its default value is still given."""
    parser = OneLineParser(prog="-")
    add_arguments(parser, cls)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def parse(cls: type[T], argv: list[str] | None = None, description: str | None = None,
          prog: str | None = None) -> T:
    """Parse ``argv`` into an instance of the dataclass ``cls``."""
    parser = OneLineParser(
        prog=prog, description=description or (inspect.getdoc(cls) or "").split("\n\n")[0])
    add_arguments(parser, cls)
    if hasattr(cls, "cli_defaults"):  # defaults that depend on another flag (a named workload)
        first = vars(parser.parse_known_args(argv)[0])
        parser.set_defaults(**cls.cli_defaults(first))
    values = vars(parser.parse_args(argv))
    hints = typing.get_type_hints(cls)
    for name, value in values.items():  # repeatable flags: a tuple, the field's default when absent
        if typing.get_origin(_base_type(hints[name])[0]) is tuple:
            values[name] = tuple(value) if value is not None else cls.__dataclass_fields__[name].default
    return cls(**values)
