"""``python -m fp_dcp``: the ``fp-dcp`` command (see ``fp_dcp.tools.cli``)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
