"""``python -m elasticd.bench``: the benchmarks' command line (see ``recovery.main``)."""

import sys

from elasticd.bench.recovery import main

sys.exit(main())
