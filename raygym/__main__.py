"""``python -m raygym`` = the ``raygym`` command."""

import sys

from raygym.cli import main

sys.exit(main())
