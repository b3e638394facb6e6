"""``python -m tollgate_cli``: the same as the ``tollgate`` command."""

import sys

from tollgate_cli.main import main

sys.exit(main())
