"""``python -m aotattn.pgdef ...``: the same commands as ``aotattn pgdef ...`` (and the same
one-line errors: it runs the ``aotattn`` command line with ``pgdef`` in front)."""

import sys

from aotattn.cli import app

app(args=["pgdef", *sys.argv[1:]], prog_name="aotattn")
