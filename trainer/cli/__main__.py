"""`python -m trainer.cli ...`: the same as `baton ...`."""

import sys

from trainer.cli.main import main

sys.exit(main())
