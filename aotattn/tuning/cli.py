"""``aotattn tuning``: show, diff, lint, squash the tuning database, and set knobs in a copy of it."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from aotattn.spec import parse_where
from aotattn.tuning.database import Database, default_root, diff
from aotattn.tuning.format import NO_ENTRY, TuningError, format_config, format_functional

app = typer.Typer(help="Inspect and maintain the tuning database (docs/tuning-database-format.md).",
                  no_args_is_help=True)
console = Console(soft_wrap=True)  # one problem, one line, whatever the terminal's width

TUNING_DB = typer.Option(None, "--tuning-db", help="database root (default: $AOTATTN_TUNING_DB or tuning/)")


def _db(root: Path | None) -> Database:
    from aotattn import families  # the command line sits above the families: it hands their tables down

    return Database(root or default_root(), families.tables())


@app.command()
def show(
    arch: str = typer.Option("sm_90", help="architecture, e.g. sm_90"),
    table: str = typer.Option("flash.attn_fwd", help="family.kernel, e.g. flash.attn_bwd_dq"),
    where: str = typer.Option(None, help='only functionals matching, e.g. "dtype=bf16 BLOCK_D=128 MASK=0"'),
    limit: int = typer.Option(4, min=1, help="at most this many functionals"),
    tuning_db: Path = TUNING_DB,
) -> None:
    """Print the effective table (after bases and patches) as grids of configuration names."""
    db = _db(tuning_db)
    spec = db.spec(table)
    wanted = parse_where(where, [spec])
    effective = db.effective(arch, table)
    chosen = [f for f in effective.blocks if f.matches(wanted, spec.axis_defaults)]
    if not chosen:
        raise TuningError(f"--where {where!r} matches none of the {len(effective.blocks)} functionals of {arch} / "
                          f"{table}")
    console.print(f"{arch} / {table}: {len(effective.blocks)} functionals, {len(chosen)} match; "
                  f"base {effective.base or '-'}; patches: "
                  f"{', '.join(p.name for p in db.patch_paths(arch, table)) or '-'}")
    for functional in chosen[:limit]:
        grid = effective.blocks[functional]
        names = sorted({name for row in grid for name in row} - {NO_ENTRY})
        letter = {name: chr(ord("a") + i) if i < 26 else str(i) for i, name in enumerate(names)}
        letter[NO_ENTRY] = NO_ENTRY
        rich = RichTable(title=escape(format_functional(spec, functional)), title_justify="left")
        keys = spec.tuning_keys
        rich.add_column(f"{keys[0][0]} \\ {keys[1][0]}" if len(keys) > 1 else (keys[0][0] if keys else ""))
        for col in (keys[1][1] if len(keys) > 1 else ("",)):
            rich.add_column(_short(col), justify="center")
        for row_label, row in zip(keys[0][1] if keys else ("*",), grid):
            rich.add_row(_short(row_label), *(letter[name] for name in row))
        console.print(rich)
        for name in names:
            console.print(f"  {letter[name]}: {name} = {format_config(effective.configs[name], spec)}")
    if len(chosen) > limit:
        console.print(f"... {len(chosen) - limit} more (narrow with --where, or raise --limit)")


def _short(bucket) -> str:
    if isinstance(bucket, int) and bucket >= 1024 and bucket % 1024 == 0:
        return f"{bucket // 1024}k"
    return str(bucket)


@app.command("diff")
def diff_command(
    arch: str = typer.Option("sm_90", help="architecture A"),
    table: str = typer.Option("flash.attn_fwd", help="family.kernel"),
    against: str = typer.Option(None, help="architecture B (default: A)"),
    rev: str = typer.Option(None, help="compare with the database at this git revision (tag, branch, commit)"),
    without_patches: bool = typer.Option(False, "--without-patches",
                                         help="compare the table before its patches with after them"),
    after_patches: int = typer.Option(None, "--after-patches", min=0,
                                      help="compare the table after its first N patches with after all of them "
                                           "(1: the cells later patches still override over 0001-tuned)"),
    tuning_db: Path = TUNING_DB,
) -> None:
    """Cell-by-cell differences: two archs, two revisions, or before and after the patches."""
    db = _db(tuning_db)
    spec = db.spec(table)
    layers = without_patches or after_patches is not None
    if (without_patches and after_patches is not None) or (layers and (rev or against)):
        raise TuningError("tuning diff: --without-patches and --after-patches compare one table's layers; "
                          "give neither --against nor --rev with them, nor both")
    if without_patches:
        after_patches = 0
    try:
        if after_patches is not None:
            count = len(db.patch_paths(arch, table))
            if after_patches > count:
                raise TuningError(f"--after-patches {after_patches}: {arch} {table} has {count} patch(es)")
            a, b = db.effective(arch, table, patches=after_patches), db.effective(arch, table)
        elif rev:
            with tempfile.TemporaryDirectory() as tmp:
                root = db.root.resolve()
                top = Path(subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], check=True,
                                          capture_output=True, text=True).stdout.strip())
                rel = root.relative_to(top)
                archive = subprocess.run(["git", "-C", str(top), "archive", rev, str(rel)], check=True,
                                         capture_output=True).stdout
                subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
                a = Database(Path(tmp) / rel, db.specs).effective(against or arch, table)
            b = db.effective(arch, table)
        else:
            a, b = db.effective(arch, table), db.effective(against or arch, table)
    except subprocess.CalledProcessError as exc:
        raise TuningError(f"--rev {rev}: git failed: {(exc.stderr or b'').decode(errors='replace').strip()}") from exc
    lines = diff(spec, a, b)
    for line in lines:
        console.print(line, markup=False)
    console.print(f"{len(lines)} difference(s)")


@app.command()
def lint(tuning_db: Path = TUNING_DB,
         fix: bool = typer.Option(False, help="rewrite in canonical form the tables that are valid and lose no "
                                  "comment; a file it does not fully understand is left alone")) -> None:
    """Validate every table and patch: every error of each file, each once, with the
    architectures it affects (``path:line``); exit 1 on any problem or an empty database."""
    db = _db(tuning_db)
    if fix:
        for path in db.fix():
            console.print(f"rewrote {path}", markup=False)
    problems = db.lint()
    for problem in problems:
        affects = f"  (affects {', '.join(problem.archs)})" if problem.archs else "  (affects no architecture)"
        console.print(escape(f"{problem}{affects}"), style="red", highlight=False)
    console.print(f"{len(problems)} problem(s) in {db.root}", markup=False, highlight=False)
    if problems:
        raise typer.Exit(1)


@app.command("set-knobs")
def set_knobs(settings: list[str] = typer.Argument(..., help="knob=value, e.g. OVERLAP=1 TMA=1"),
              arch: str = typer.Option("sm_90", help="architecture"),
              table: str = typer.Option("flash.attn_fwd", help="family.kernel"),
              tuning_db: Path = typer.Option(..., "--tuning-db", help="the database to rewrite: a copy, for an "
                                             "experiment (cp -r tuning build/tuning-x)")) -> None:
    """Give every configuration of a table (and its patches) these knob values, in place:
    every cell then runs its tiles with them (an A/B of a knob over a whole table)."""
    knobs = {}
    for setting in settings:
        knob, eq, value = setting.partition("=")
        if not eq or not knob or not value:
            raise TuningError(f"expected knob=value, got {setting!r}")
        knobs[knob] = value
    db = _db(tuning_db)
    for path in db.set_knobs(arch, table, knobs):
        console.print(f"rewrote {path}", markup=False)


@app.command()
def squash(arch: str = typer.Option(..., help="architecture"),
           table: str = typer.Option(..., help="family.kernel"),
           tuning_db: Path = TUNING_DB) -> None:
    """Fold a table's patches into its file and delete them (for a release)."""
    db = _db(tuning_db)
    removed = db.squash(arch, table)
    console.print(f"folded {len(removed)} patch(es) into {db.table_path(arch, table)}", markup=False,
                  highlight=False)
