"""The consoles of the command-line tools: tables are never cut.

rich sizes a console that is not a terminal (a pipe, a log file, CI) to 80 columns and squeezes
or ellipsizes table columns to fit. Here such a console is as wide as its content needs
(``WIDE``), so logs keep every cell; on a terminal rich uses the terminal's width (and wraps).
Errors go to stderr, on one line.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.markup import escape

WIDE = 1000
"""Columns of a console that is not a terminal: tables keep their natural width."""


def make_console(*, stderr: bool = False, file: TextIO | None = None) -> Console:
    stream = file or (sys.stderr if stderr else sys.stdout)
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=file, stderr=stderr, width=None if tty else WIDE)


def print_error(message: str) -> None:
    """``error: <message>`` on stderr, one line whatever the width (the message is not markup)."""
    make_console(stderr=True).print(f"[red]error:[/] {escape(' '.join(message.split()))}",
                                    soft_wrap=True)


def print_notice(message: str) -> None:
    """``notice: <message>`` on stderr, one line (a setting honoured by other kernels)."""
    make_console(stderr=True).print(f"[yellow]notice:[/] {escape(' '.join(message.split()))}",
                                    soft_wrap=True)
