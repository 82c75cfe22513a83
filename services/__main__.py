"""`python -m services <command>`: the serving commands (services/main.py)."""

import sys

from services.main import main

sys.exit(main())
