"""``python -m dsdmerge``: the same as the ``dsdmerge`` command."""

import sys

from dsdmerge.cli import main

sys.exit(main())
