"""The command line's parser: a mistake is one line that says what is wrong, not argparse's
usage (21 lines for ``pd-router``) with the line that matters last.

``pd-router``, ``pd-router demo`` and ``pd-router status`` all parse with it.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def mistake(self, message: str) -> NoReturn:
        """A word the command does not know, or a setting it lacks: its ``--help`` lists
        them. (A bad value needs no hint: its error says what the value may be.)"""
        self.error(f"{message}; see {self.prog} --help")


def parse(parser: Parser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args``, with a suggestion for a misspelt flag."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        flags = [flag for action in parser._actions for flag in action.option_strings]
        parser.mistake(f"unrecognized arguments: {' '.join(extras)}{suggest(extras[0], flags)}")
    return args


def suggest(word: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the known word closest to ``word``, if one is close."""
    # Closer than difflib's default (0.6), which offers --host for --bogus.
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""
