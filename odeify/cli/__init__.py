"""The ``odeify`` command: the parser (``parser``) and what each command does (``commands``).

``main`` is the console-script entry point; importing this package does not import torch.
"""

from odeify.cli.parser import main

__all__ = ["main"]
