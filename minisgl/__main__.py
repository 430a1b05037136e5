"""`python -m minisgl ...` is the `minisgl` command (see minisgl/cli.py)."""

import sys

from minisgl.cli import main

sys.exit(main())
