"""``python -m ftcomm`` runs the ``ftcomm`` command."""

import sys

from .cli import main

sys.exit(main())
