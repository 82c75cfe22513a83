"""`python -m cli <command>`: the `alise` command (cli/main.py)."""

import sys

from cli.main import main

sys.exit(main())
