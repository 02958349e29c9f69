"""``python -m ftcomm`` runs the ``ftcomm`` command."""

import sys

from .ops.cli import main

sys.exit(main())
