"""``python -m disttrain_lab``: the ``disttrain-lab`` command (cli.py)."""

import sys

from .cli import main

sys.exit(main())
