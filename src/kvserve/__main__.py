"""``python -m kvserve`` runs the ``kvserve`` command line."""

import sys

from kvserve.cli import main

sys.exit(main())
