"""``python -m odeify`` (and ``torchrun -m odeify``): the odeify command."""

import sys

from odeify.cli.parser import main

sys.exit(main())
