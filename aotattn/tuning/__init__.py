"""The human-readable tuning database (docs/tuning-database-format.md).

Family-agnostic: tables are validated against the specs the families declare, handed
down by the package root (:func:`use_tables`) or by the caller (``Database(root, specs)``).
"""

from aotattn.tuning.database import ENV_VAR, Database, database, diff, use_tables
from aotattn.tuning.format import (NoEntryError, Patch, Table, TuningError, apply_patch, bucket_index, parse_patch, parse_table,
                                   write_patch, write_table)

__all__ = ["ENV_VAR", "Database", "NoEntryError", "Patch", "Table", "TuningError", "apply_patch", "bucket_index", "database", "diff",
           "parse_patch", "parse_table", "use_tables", "write_patch", "write_table"]
