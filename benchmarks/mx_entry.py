"""``mxtrain`` entry point for benchmarks: MXTRAIN_FAST=0 forces the reference MXLinear path
(``mxtrain.fast.ENABLED = False``) in this process; usable as a torchrun script."""
import os
import sys

import mxtrain.fast as fast

fast.ENABLED = os.environ.get("MXTRAIN_FAST", "1") != "0"
from mxtrain.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
