"""``python -m tests.mutants [--device cpu|cuda] [--only NAME ...] [--jobs N] [--list]``

Runs, for each mutant of :mod:`tests.mutants`, its killer tests in a subprocess with
``AOTATTN_MUTANT=<name>`` and prints whether they caught it, then the mutation score
(caught / injected). Exits 1 below 100%. First the same tests run without any mutant
and must pass (``--no-baseline`` skips that, when the suite has just passed anyway).

``--device cuda`` selects the tests' GPU parametrizations (GPU-sized shapes) and
compiles the mutated kernels with Triton's JIT; mutants of host code (argument checks)
and those a CPU check of the compiled code catches run their CPU tests on either device.
A mutant of a forward kernel runs with that kernel forced wherever it serves (the sm_90
tables choose the warp-specialized one at the tests' sizes), and so does its baseline.
Mutants of Gluon kernels (the ws forward and backward) run with ``--device cuda`` on sm_90 only; another run
counts the others and says how many it left. On the H200::

    AOTATTN_MODE=jit python -m tests.mutants --device cuda --jobs 6
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tests.mutants import MUTANTS, Mutant
from tests.mutants.loader import ENGINE_VAR, ROOT, VAR

# pytest's exit codes: 0 all passed, 1 some failed; 2-5 mean the run itself went wrong
# (interrupted, internal error, usage, nothing collected). A negative code is a signal:
# the mutant crashed the process, which the suite would report as a failure too.
PASSED, FAILED = 0, 1


@dataclass(frozen=True)
class Outcome:
    name: str
    result: str  # "caught", "survived" or "error"
    seconds: float
    detail: str


def pytest_command(node_ids: list[str], device: str) -> list[str]:
    marker = "gpu" if device == "cuda" else "not gpu"
    return [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", "-m", marker, *node_ids]


def _run(command: list[str], mutant: str | None, device: str, timeout: float,
         engine: str | None = None) -> tuple[int | None, str]:
    env = {k: v for k, v in os.environ.items() if k not in (VAR, ENGINE_VAR)}
    if mutant:
        env[VAR] = mutant
    if engine:
        env[ENGINE_VAR] = engine
    if device == "cuda":
        env["AOTATTN_MODE"] = "jit"
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    return done.returncode, done.stdout + done.stderr


def _device_of(mutant: Mutant, device: str) -> str:
    return "cpu" if mutant.killed_on_cpu else device


def run_mutant(mutant: Mutant, device: str, timeout: float) -> Outcome:
    device = _device_of(mutant, device)
    start = time.monotonic()
    code, output = _run(pytest_command(mutant.node_ids(device), device), mutant.name, device, timeout)
    seconds = time.monotonic() - start
    failed = re.search(r"^FAILED (\S+)", output, re.MULTILINE)
    if code == FAILED:
        return Outcome(mutant.name, "caught", seconds, failed.group(1) if failed else "a test failed")
    if code is not None and code < 0:
        return Outcome(mutant.name, "caught", seconds, f"the test process crashed (signal {-code})")
    if code == PASSED:
        return Outcome(mutant.name, "survived", seconds, "every killer test passed")
    tail = "\n".join(output.strip().splitlines()[-15:])
    return Outcome(mutant.name, "error", seconds, f"pytest exit code {code}:\n{tail}")


def baseline_pieces(groups: dict[tuple[str, str | None], list[str]],
                    jobs: int) -> list[tuple[tuple[str, str | None], list[str]]]:
    """Each (device, engine) group's test ids dealt round-robin into pieces, the largest group
    first, so that there are at least ``jobs`` pieces where there are that many tests; every
    test lands in exactly one piece, which keeps its group's device and engine."""
    total = sum(len(ids) for ids in groups.values())
    out = []
    for key, ids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        n = max(1, min(len(ids), -(-max(1, jobs) * len(ids) // max(1, total))))
        out += [(key, ids[i::n]) for i in range(n)]
    return out


def baseline(mutants: list[Mutant], device: str, timeout: float, jobs: int = 1) -> str | None:
    """None when every mutant's killer tests pass unmutated, on the forward engine the
    mutant forces (tests.mutants.loader.force_forward_engine); else what failed. The groups
    (device, engine) run at once, up to ``jobs``: on a GPU machine with a cold Triton cache
    each compiles its kernels, and one after another they outlasted a 330 s call (2026-12-07).
    Four groups on six jobs still took 350 s cold (sixty-first session), so each group's tests
    are dealt out into pieces, enough of them to keep every job busy."""
    groups: dict[tuple[str, str | None], list[str]] = {}
    for m in mutants:
        ids = groups.setdefault((_device_of(m, device), m.forward_engine), [])
        ids += [i for i in m.node_ids(device) if i not in ids]
    pieces = baseline_pieces(groups, jobs)

    def run_group(group: tuple[tuple[str, str | None], list[str]]) -> str | None:
        (dev, engine), node_ids = group
        code, output = _run(pytest_command(node_ids, dev), None, dev, timeout, engine)
        if code == PASSED:
            return None
        return (f"({dev}{', forward engine ' + engine if engine else ''}) exit code {code}:\n"
                + "\n".join(output.strip().splitlines()[-20:]))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        failures = [f for f in pool.map(run_group, pieces) if f]
    return failures[0] if failures else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[1])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutants only")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the killer tests")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    unknown = sorted(set(args.only or ()) - set(by_name))
    if unknown:
        parser.error(f"--only: no mutant {unknown}; expected names from {sorted(by_name)}")
    mutants = [by_name[n] for n in args.only] if args.only else list(MUTANTS)
    if args.list:
        for m in mutants:
            print(f"{m.name:24s} {m.path:44s} {m.mistake}")
        return 0
    runs_gluon = False
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU here")
        runs_gluon = torch.cuda.get_device_capability() == (9, 0)  # the Gluon kernels are sm_90's
    gpu_only = [m for m in mutants if m.gpu_only and not runs_gluon]
    if gpu_only and args.only:
        parser.error(f"--only: {', '.join(m.name for m in gpu_only)} mutate a Gluon kernel, which runs on sm_90 "
                     "GPUs only: add --device cuda on an H100 or H200")
    mutants = [m for m in mutants if m not in gpu_only]
    if not args.no_baseline:
        start = time.monotonic()
        failure = baseline(mutants, args.device, args.timeout, args.jobs)
        if failure:
            print(f"baseline: the killer tests fail without any mutant, so no score can be given: {failure}")
            return 2
        print(f"baseline: the killer tests pass without a mutant ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"{'mutant':24s} {'result':9s} {'seconds':>7s}  caught by")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = []
        for outcome in pool.map(lambda m: run_mutant(m, args.device, args.timeout), mutants):
            print(f"{outcome.name:24s} {outcome.result:9s} {outcome.seconds:7.1f}  {outcome.detail}", flush=True)
            outcomes.append(outcome)
    caught = sum(o.result == "caught" for o in outcomes)
    unrun = f"; {len(gpu_only)} mutants of Gluon kernels not run (--device cuda on sm_90 runs them)" if gpu_only else ""
    print(f"mutation score ({args.device}): {caught}/{len(outcomes)} caught ({100 * caught / len(outcomes):.0f}%)"
          f"{unrun}")
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
