"""`python -m isotrain ...` (what `torchrun -m isotrain train` runs)."""

import sys

from isotrain.train.cli.main import main

sys.exit(main())
