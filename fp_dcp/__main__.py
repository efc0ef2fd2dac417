"""``python -m fp_dcp``: the ``fp-dcp`` command (see ``fp_dcp.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
