"""`python -m vlserve.cli`: the command line as the `vlserve` script runs it (the benchmarks start workers so)."""

import sys

from vlserve.cli import main

sys.exit(main())
