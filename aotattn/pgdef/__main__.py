"""``python -m aotattn.pgdef ...``: the same commands as ``aotattn pgdef ...``."""

from aotattn.pgdef.cli import app

app(prog_name="aotattn pgdef")
