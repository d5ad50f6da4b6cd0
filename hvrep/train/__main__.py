"""``python -m hvrep.train``: the same as ``hvrep train``."""

import sys

from hvrep.train.main import main

sys.exit(main())
