"""``python -m voltrl.cli``: the ``voltrl`` command."""

import sys

from voltrl.cli.main import main

sys.exit(main())
