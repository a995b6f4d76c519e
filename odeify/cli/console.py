"""Where the command line writes: the rich console of its tables, and the log lines on stdout."""

from __future__ import annotations

import logging
import sys
from typing import IO

TABLE_WIDTH = 120  # rich's width when the stream is not a terminal (its own default, 80, wraps the tables)

CLI_SPELLINGS = (
    ("(memory=)", "(--calibrate-memory)"),
    ("(odeify.set_steps(model, steps), --steps)", "(--steps)"),
    (
        "(odeify.calibrate(model, data, steps=[...]))",
        "(odeify calibrate --calibrate-steps-set DEPTHS, or odeify finetune --depths DEPTHS)",
    ),
)
"""The library's Python spellings in its log lines and warnings, and the command line's for them."""


def cli_words(text: str) -> str:
    """``text`` with the library's Python spellings (:data:`CLI_SPELLINGS`) in the command line's."""
    for python, flag in CLI_SPELLINGS:
        text = text.replace(python, flag)
    return text


def console_on(stream: IO[str]):
    """A rich console on ``stream``, wide enough for the tables when it is not a terminal."""
    from rich.console import Console  # lazily: ``odeify --help`` stays fast

    console = Console(file=stream, highlight=False)
    if not console.is_terminal:
        console = Console(file=stream, highlight=False, width=TABLE_WIDTH)
    return console


def stdout_is_data(args) -> bool:
    """Whether a command's standard output is data for a script (JSON, code, the sweep's table), so
    that its tables and log lines go to standard error instead."""
    return bool(getattr(args, "json", False) or getattr(args, "code", False)) or args.command == "sweep"


def tables(args):
    """Where a command's tables go: stdout, or stderr when stdout carries data (:func:`stdout_is_data`)."""
    return console_on(sys.stderr if stdout_is_data(args) else sys.stdout)


def note(message: str) -> None:
    """A line for the reader, beside the results: on stderr."""
    print(message, file=sys.stderr)


class _TqdmHandler(logging.Handler):
    """Writes each record with ``tqdm.write``, so that a progress bar on the terminal stays whole.

    A record logged with ``extra={"once": True}`` (a note about an input, which a command may read
    more than once) is written the first time only.
    """

    def __init__(self, to_stderr: bool) -> None:
        super().__init__()
        self.to_stderr = to_stderr
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "once", False):
            if record.getMessage() in self.said:
                return
            self.said.add(record.getMessage())
        try:
            from tqdm import tqdm

            tqdm.write(cli_words(self.format(record)), file=sys.stderr if self.to_stderr else sys.stdout)
        except Exception:  # a closed stream must not stop the run
            self.handleError(record)


def print_log_lines(to_stderr: bool, level: int = logging.INFO) -> None:
    """Print the ``odeify`` logger's lines, plain, on stdout (or stderr): what every command does.

    The library logs (``logging.getLogger("odeify")``, as timm's modules do); the command line is the
    application that decides where the lines go.
    """
    logger = logging.getLogger("odeify")
    for handler in [h for h in logger.handlers if isinstance(h, _TqdmHandler)]:
        logger.removeHandler(handler)
    handler = _TqdmHandler(to_stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def print_warnings_plainly() -> None:
    """Show Python warnings as ``odeify: warning: MESSAGE`` on stderr, once each, without the source
    line Python prints (a user of the command line has no use for odeify's code), in its flags."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        text = cli_words(" ".join(str(message).split()))
        print(f"odeify: warning: {text}", file=file or sys.stderr)

    warnings.showwarning = show
