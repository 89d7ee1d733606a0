"""`python -m experiments.bench.gpu_suite`."""

import sys

from experiments.bench.gpu_suite import main

sys.exit(main())
