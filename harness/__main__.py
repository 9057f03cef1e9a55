"""`python -m harness` is `mhc-harness`."""

import sys

from harness.cli import main

sys.exit(main())
