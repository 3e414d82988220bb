"""``python -m minishard.run.cli train ...``, as ``python -m minishard train ...``."""

import sys

from minishard.run.cli import main

sys.exit(main())
