"""``python -m minishard train ...`` runs the CLI."""

import sys

from minishard.cli import main

sys.exit(main())
