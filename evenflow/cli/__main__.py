"""``python -m evenflow.cli``: the ``evenflow`` command."""

import sys

from evenflow.cli import main

sys.exit(main())
