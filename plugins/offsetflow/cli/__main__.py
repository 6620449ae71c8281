"""`python -m offsetflow.cli`: the `offsetflow` command without its console script."""

import sys

from offsetflow.cli import main

sys.exit(main())
