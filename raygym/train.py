"""``python -m raygym.train [flags]`` = ``raygym train [flags]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from raygym.cli.main import main as _cli_main


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``raygym train`` with ``argv`` (default: the process arguments); returns the exit code."""
    return _cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
