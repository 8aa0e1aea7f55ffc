"""A method's declared options: each one's name, type, range or choices, default and help, and the check of
what a user gives (``--option KEY=VALUE``, the Flower run config's ``options``, the Python API's ``options``).

A method module owns its declaration (:attr:`training.protocol.Method.options`, a tuple of :class:`Option`);
its defaults, ``fedmosaic train --method M --help-options`` and the check all read that one tuple. The check
(:func:`check_options`) names an unknown key with the closest declared one (:mod:`difflib`) and every valid
key, and a bad value with the expected type and range; values are kept as given (JSON ``1`` stays an int
for a float option), so ``--print-config`` prints what was asked for.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class OptionError(ValueError):
    """A method option that is not declared, or whose value is of the wrong type or out of range."""


@dataclass(frozen=True)
class Option:
    """One method option.

    Attributes:
        name: the key (``alpha``); a dashed spelling (``shared-expert``) is read as the underscored one.
        kind: ``float``, ``int``, ``bool``, ``str`` or ``list`` (a JSON list of strings, or one string
            with commas).
        default: the value when the option is not given.
        help: one line: what it does.
        low: smallest value (numbers), inclusive unless ``open_low``.
        high: largest value (numbers), inclusive unless ``open_high``.
        open_low: ``low`` itself is excluded.
        open_high: ``high`` itself is excluded.
        choices: the accepted values (strings, or ints such as ``local_from``'s 0 and 1).
        nullable: JSON ``null`` is accepted (the option's "off", e.g. ``clip_norm``).
        listed: the default is part of the method's defaults (run.json, ``--print-config``); False for an
            opt-in whose absence is its default (robust aggregation's options).
    """

    name: str
    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple[Any, ...] = ()
    nullable: bool = False
    listed: bool = True

    def expected(self) -> str:
        """What a valid value is, in words (``a number in [0, 1]``, ``one of 'equal', 'num_examples'``)."""
        if self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind is bool:
            text = "true or false"
        elif self.kind is list:
            text = "a list of names (JSON, or comma-separated)"
        elif self.kind is str:
            text = "a string"
        else:
            text = ("an integer" if self.kind is int else "a number") + self._range()
        return text + (" or null" if self.nullable else "")

    def _range(self) -> str:
        if self.low is not None and self.high is not None:
            return f" in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"
        if self.low is not None:
            return f" {'>' if self.open_low else '>='} {self.low:g}"
        if self.high is not None:
            return f" {'<' if self.open_high else '<='} {self.high:g}"
        return ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not valid for this option, or None when it is."""
        if value is None:
            return None if self.nullable else "null"
        if self.choices:
            ok = any(value == c and type(value) is type(c) for c in self.choices)
            return None if ok else repr(value)
        if self.kind is bool:
            return None if isinstance(value, bool) else repr(value)
        if self.kind is str:
            return None if isinstance(value, str) else repr(value)
        if self.kind is list:
            ok = isinstance(value, str) or (isinstance(value, list | tuple) and all(isinstance(v, str) for v in value))
            return None if ok else repr(value)
        number = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            return repr(value)
        below = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        above = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        return repr(value) if below or above else None

    def usage(self) -> str:
        """One line for ``--help-options``: name, expected value, default, help."""
        return f"{self.name}: {self.expected()}; default {json.dumps(self.default)}. {self.help}"


def key(name: str) -> str:
    """An option key as declared: dashes read as underscores."""
    return name.replace("-", "_")


def declared_defaults(options: Iterable[Option]) -> dict[str, Any]:
    """The listed options' defaults (a method's ``defaults``)."""
    return {o.name: o.default for o in options if o.listed}


def check_options(method: str, declared: Iterable[Option], given: Mapping[str, Any],
                  where: str = "--option") -> dict[str, Any]:
    """Check ``given`` against ``method``'s ``declared`` options; return them under their declared names.

    Args:
        method: the method's name, for the message.
        declared: its options.
        given: the user's options (keys as typed).
        where: where they came from (``--option``, ``the Flower run config's options``), for the message.

    Returns:
        ``given`` with dashed keys spelled as declared (``local-from`` -> ``local_from``), values unchanged.

    Raises:
        OptionError: an undeclared key (the closest declared one and every valid key named), a key given in
            both spellings, or a value of the wrong type or out of range (the expected type and range named).
    """
    table = {o.name: o for o in declared}
    checked: dict[str, Any] = {}
    for name, value in given.items():
        if key(str(name)) in checked:
            raise OptionError(f"{where}: {method}'s option {key(str(name))} is given twice ({name!r} and another "
                              "spelling)")
        option = table.get(key(str(name)))
        if option is None:
            valid = sorted(table)
            close = difflib.get_close_matches(key(str(name)), valid, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            listing = f"its options: {', '.join(valid)}" if valid else "it takes no options"
            raise OptionError(f"{where}: {method} has no option {name!r}{hint}; {listing}")
        bad = option.problem(value)
        if bad is not None:
            raise OptionError(f"{where}: {method}'s option {option.name} must be {option.expected()}, got {bad}")
        checked[option.name] = value
    return checked
