"""Where the command line writes: the rich console of its tables, and the log lines on stdout."""

from __future__ import annotations

import logging
import sys
from typing import IO

TABLE_WIDTH = 120  # rich's width when the stream is not a terminal (its own default, 80, wraps the tables)


def console_on(stream: IO[str]):
    """A rich console on ``stream``, wide enough for the tables when it is not a terminal."""
    from rich.console import Console  # lazily: ``odeify --help`` stays fast

    console = Console(file=stream, highlight=False)
    if not console.is_terminal:
        console = Console(file=stream, highlight=False, width=TABLE_WIDTH)
    return console


class _TqdmHandler(logging.Handler):
    """Writes each record with ``tqdm.write``, so that a progress bar on the terminal stays whole."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # a closed stream must not stop the run
            self.handleError(record)


def log_to_stdout(level: int = logging.INFO) -> None:
    """Print the ``odeify`` logger's lines on standard output, plain: what every command does.

    The library logs (``logging.getLogger("odeify")``, as timm's modules do); the command line is the
    application that decides where the lines go.
    """
    logger = logging.getLogger("odeify")
    if not any(isinstance(h, _TqdmHandler) for h in logger.handlers):
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
