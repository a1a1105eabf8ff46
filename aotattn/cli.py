"""The ``aotattn`` command line: one entry point, one subcommand per job.

Every error ends as one line on stderr saying what is wrong and what to do, exit status 1
(2 for a usage error); ``aotattn --debug ...`` or ``AOTATTN_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import os
import platform
import time

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

# click's exception base (vendored by newer typer): usage errors and the like
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _debug_from_environment() -> bool:
    """``AOTATTN_DEBUG`` as a flag: 1/true/yes/on turn tracebacks on; 0, false, no, off or empty do not."""
    return os.environ.get("AOTATTN_DEBUG", "").strip().lower() in ("1", "true", "yes", "on", "y", "t")


class _OneLineErrors(TyperGroup):
    """A command group whose errors are one line each (see the module docstring)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _ClickException as exc:
            self._usage_error(exc)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except _ClickException as exc:
            self._usage_error(exc)
        except Exception as exc:
            if ctx.params.get("debug") or _debug_from_environment():
                raise
            from aotattn.errors import AotattnError
            from aotattn.pgdef.errors import PgdefError

            # what aotattn raises for users (its own errors, pgdef's, bad values, files); anything else is a bug
            if isinstance(exc, (AotattnError, PgdefError, ValueError, OSError)) and str(exc):
                typer.echo(f"aotattn: error: {_one_line(str(exc))}", err=True)
            else:
                typer.echo(f"aotattn: internal error: {type(exc).__name__}: {_one_line(str(exc))} (a bug in aotattn: "
                           "rerun as aotattn --debug ... for the traceback, and report it)", err=True)
            raise typer.Exit(1) from None

    @staticmethod
    def _usage_error(exc) -> None:
        if type(exc).__name__ == "NoArgsIsHelpError" or exc.exit_code == 0:  # help was asked for
            raise exc
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "aotattn"
        typer.echo(f"{command}: error: {_one_line(exc.format_message())} (see {command} --help)", err=True)
        raise typer.Exit(exc.exit_code)


app = typer.Typer(
    name="aotattn",
    cls=_OneLineErrors,
    help="aotattn: flash attention in Triton, compiled ahead of time.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(soft_wrap=True)  # one line per message, whatever the terminal's width


def _version(value: bool) -> None:
    if value:
        import aotattn

        typer.echo(f"aotattn {aotattn.__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version"),
    debug: bool = typer.Option(False, "--debug",  # AOTATTN_DEBUG is read by _debug_from_environment: a value
                               # click does not take (2, maybe) stopped every subcommand with a usage error
                               help="on an error, show the full traceback instead of one line (also "
                                    "AOTATTN_DEBUG=1)"),
) -> None:
    """aotattn: flash attention in Triton, compiled ahead of time."""


def _register_subcommands() -> None:
    from aotattn.compiler.cli import build_command, images_app
    from aotattn.perfmon.cli import perfdb_app, perfmon_app
    from aotattn.pgdef.cli import app as pgdef_app
    from aotattn.tune.cli import app as tune_app
    from aotattn.tuning.cli import app as tuning_app

    app.add_typer(tuning_app, name="tuning")
    app.add_typer(tune_app, name="tune")
    app.command("build")(build_command)
    app.add_typer(images_app, name="images")
    app.add_typer(pgdef_app, name="pgdef")
    app.add_typer(perfmon_app, name="perfmon")
    app.add_typer(perfdb_app, name="perfdb")


_register_subcommands()


@app.command()
def info() -> None:
    """Print versions and the device aotattn would use."""
    import torch

    import aotattn

    table = Table(show_header=False)
    table.add_row("aotattn", aotattn.__version__)
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    try:
        import triton

        table.add_row("triton", triton.__version__)
    except ImportError:
        table.add_row("triton", "not installed")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        table.add_row("device", f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)")
    else:
        table.add_row("device", "no CUDA GPU: CPU tensors run in Triton's interpreter")
    console.print(table)


class _Check:
    """One case of ``aotattn check``: forward and backward against the float64 reference."""

    TOLERANCE = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-5}

    def __init__(self, name: str, dtype, heads_k: int, mask: dict):
        self.name, self.dtype, self.heads_k, self.mask = name, dtype, heads_k, mask

    def run(self, device: str, small: bool, generator) -> tuple[str, list[tuple[str, float]], float]:
        import torch

        import aotattn
        from aotattn import reference

        seqlen_q, seqlen_k = (40, 56) if small else (1000, 1500)
        shapes = [(2, seqlen_q, 4, 64)] + [(2, seqlen_k, self.heads_k, 64)] * 2 + [(2, seqlen_q, 4, 64)]
        q, k, v, dout = (torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes)
        inputs = [t.to(device=device, dtype=self.dtype).requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        out = aotattn.flash_attn_func(*inputs, **self.mask)
        grads = torch.autograd.grad(out, inputs, dout.to(device=device, dtype=self.dtype))
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        exact = [t.detach().cpu().double().requires_grad_() for t in inputs]
        ref, _ = reference.attention(*exact, **self.mask)
        ref_grads = torch.autograd.grad(ref, exact, dout.to(self.dtype).double())
        errors = [(name, (got.detach().cpu().double() - want).norm().item() / want.norm().item())
                  for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))]
        return " / ".join("x".join(map(str, t.shape)) for t in inputs[:2]), errors, elapsed


_CASES = [
    ("full", "bfloat16", 4, {}),
    ("causal", "float16", 4, {"causal": True}),
    ("window top-left", "float32", 4, {"window_size": (8, 2), "diagonal": "top_left"}),
    ("gqa causal", "bfloat16", 1, {"causal": True}),
]


@app.command()
def check(
    device: str = typer.Option(None, help="cuda or cpu; default: cuda when present, else cpu"),
    seed: int = typer.Option(0, min=0, max=2**63 - 1, help="seed of the random inputs (the same seed, the same inputs)"),
) -> None:
    """Run forward and backward on a few problems against the float64 reference; exit 1 when any is off.

    On a machine without a GPU this runs the Triton kernels in Triton's interpreter
    (small sizes, under a minute).
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(f"--device cuda: torch {torch.__version__} has no CUDA device ({build}); run aotattn check "
                         "--device cpu, or install a CUDA build of torch")
    table = Table(title=f"aotattn check on {device}, seed {seed}")
    for column in ("case", "dtype", "q / k (B x S x H x D)", "tensor", "rel. error", "bound", "fwd+bwd ms", "result"):
        table.add_column(column)
    generator = torch.Generator().manual_seed(seed)
    checks = failures = 0
    for name, dtype_name, heads_k, mask in _CASES:
        case = _Check(name, getattr(torch, dtype_name), heads_k, mask)
        shapes, errors, elapsed = case.run(device, device == "cpu", generator)
        bound = _Check.TOLERANCE[dtype_name]
        for i, (tensor, err) in enumerate(errors):
            ok = err < bound  # NaN fails
            checks, failures = checks + 1, failures + (not ok)
            table.add_row(name if i == 0 else "", dtype_name if i == 0 else "", shapes if i == 0 else "", tensor,
                          f"{err:.2e}", f"{bound:.0e}", f"{elapsed:.1f}" if i == 0 else "",
                          "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    console.print(table)
    verdict = "all passed" if not failures else f"{failures} FAILED (bounds are relative errors against float64)"
    console.print(f"aotattn check: {checks} checks on {device} (seed {seed}), {verdict}", highlight=False)
    if failures:
        raise typer.Exit(code=1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
