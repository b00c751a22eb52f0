"""``python -m mxtrain.bench``: the same as ``mxtrain bench``."""

import sys

from .suite import main

sys.exit(main())
