"""The ``aotattn`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import platform
import time

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="aotattn: flash attention in Triton, compiled ahead of time.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


def _register_subcommands() -> None:
    from aotattn.build.cli import build_command, images_app
    from aotattn.tuning.cli import app as tuning_app

    app.add_typer(tuning_app, name="tuning")
    app.command("build")(build_command)
    app.add_typer(images_app, name="images")


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


@app.command()
def check(
    device: str = typer.Option(None, help="cuda or cpu; default: cuda when present, else cpu"),
) -> None:
    """Run attention on a few problems and compare with the float64 reference.

    On a machine without a GPU this runs the Triton kernels in Triton's interpreter
    (small sizes, a few seconds).
    """
    import torch

    import aotattn
    from aotattn import reference

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    small = device == "cpu"
    tolerance = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}
    cases = [
        ("full", torch.bfloat16, {}),
        ("causal", torch.float16, {"causal": True}),
        ("window top-left", torch.float32, {"window_size": (8, 2), "diagonal": "top_left"}),
        ("gqa causal", torch.bfloat16, {"causal": True}),
    ]
    table = Table(title=f"aotattn check on {device}")
    for column in ("case", "dtype", "q / k (B x S x H x D)", "rel. error", "bound", "ms", "result"):
        table.add_column(column)
    failures = 0
    torch.manual_seed(time.time_ns() % 2**31)
    for name, dtype, mask in cases:
        heads_k = 1 if name.startswith("gqa") else 4
        seqlen_q, seqlen_k = (40, 56) if small else (1000, 1500)
        q = torch.randn(2, seqlen_q, 4, 64, dtype=dtype, device=device)
        k = torch.randn(2, seqlen_k, heads_k, 64, dtype=dtype, device=device)
        v = torch.randn(2, seqlen_k, heads_k, 64, dtype=dtype, device=device)
        start = time.perf_counter()
        out = aotattn.flash_attn_func(q, k, v, **mask)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        ref, _ = reference.attention(q.cpu(), k.cpu(), v.cpu(), **mask)
        err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        ok = err < tolerance[dtype]
        failures += not ok
        shapes = " / ".join("x".join(map(str, t.shape)) for t in (q, k))
        table.add_row(name, str(dtype).removeprefix("torch."), shapes,
                      f"{err:.2e}", f"{tolerance[dtype]:.0e}", f"{elapsed:.1f}",
                      "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    console.print(table)
    if failures:
        raise typer.Exit(code=1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
