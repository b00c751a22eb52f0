"""``mxtrain`` entry point for benchmarks: MXTRAIN_FAST=0 (the ``fast`` setting, read from the environment)
forces the reference MXLinear path in this process; usable as a torchrun script."""
import sys

from mxtrain.cli.core import main

sys.exit(main(sys.argv[1:]))
