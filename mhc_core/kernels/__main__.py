"""`python -m mhc_core.kernels`: the preflight report (`mhc_core.kernels.preflight`)."""

import sys

from mhc_core.kernels.preflight import main

sys.exit(main())
