"""``python -m attnlens.cli``: the same as the ``attnlens`` console script."""

import sys

from . import main

sys.exit(main())
