"""``python -m stagewise.cli``: the ``stagewise`` command without its console script."""

import sys

from .main import main

sys.exit(main())
