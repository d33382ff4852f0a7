"""``python -m raygym`` = the ``raygym`` command."""

import sys

from raygym.cli.main import main

sys.exit(main())
