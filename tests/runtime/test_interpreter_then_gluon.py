"""A process that interprets a kernel on CPU tensors can still compile Gluon kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WS = "tests/families/flash/test_backward_ws.py"


def test_a_gluon_compile_after_an_interpreted_launch_in_a_fresh_process(tmp_path):
    """Triton 3.6 imports Gluon lazily from inside an interpreted launch, with
    triton.language's builtins patched, and Gluon's builtins then wrap the patched
    functions: every later Gluon compile in the process failed ("Did you forget to add
    @triton.gluon.jit ?"). Seen as these two tests failing when run in this order in one
    process; aotattn.runtime.interpreter now imports Gluon before it interprets anything."""
    tests = [f"{WS}::test_explicit_ws_where_it_does_not_serve_says_what_does_in_one_line",
             f"{WS}::test_it_compiles_to_warp_partitions_with_wgmma_and_bulk_copies_and_reduces[d64-1]"]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}  # compiled for real, not from a cache
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 passed" in done.stdout
