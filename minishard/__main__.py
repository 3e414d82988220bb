"""``python -m minishard train ...`` runs the CLI."""

import sys

from minishard.run.cli import main

sys.exit(main())
