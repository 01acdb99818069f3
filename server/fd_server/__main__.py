"""``python -m fd_server [flags]`` is ``fd serve [flags]``."""

from __future__ import annotations

import sys


def main() -> int:
    from fd_core.entrypoints.cli import main as fd_main

    return int(fd_main(["serve", *sys.argv[1:]]) or 0)


if __name__ == "__main__":
    sys.exit(main())
