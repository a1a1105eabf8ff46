"""The command line as a user meets it (issue 16, item 4): every error one line saying what
is wrong and what to do, no traceback unless --debug; --version; --where checked against
the kernels' axes; images commands follow AOTATTN_IMAGES; ``check`` runs forward and
backward on seeded inputs and ends with a summary line."""

from __future__ import annotations

import os
import re
import textwrap

import pytest
import torch
from typer.testing import CliRunner

import aotattn
from aotattn import families
from aotattn.compiler import enumerate_jobs
from aotattn.cli import app
from aotattn.runtime import images
from aotattn.tuning import Database


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def error_line(result, code: int = 1) -> str:
    """The one line an error prints (on stderr), with no traceback."""
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"aotattn {aotattn.__version__}"


def test_an_unknown_arch_is_one_line_naming_the_known_ones(tmp_path):
    line = error_line(invoke("build", "--arch", "sm_91", "--out", str(tmp_path)))
    assert "sm_91" in line and "sm_90" in line and "gfx942" in line
    assert not (tmp_path / "sm_91").exists()


def test_check_on_a_missing_device_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = error_line(invoke("check", "--device", "cuda"))
    assert "--device cpu" in line
    assert "--device" in error_line(invoke("check", "--device", "tpu"))


@pytest.mark.parametrize("args", [("check", "--seed", str(10**20)), ("check", "--seed", "-1"),
                                  ("perfmon", "run", "--tag", "x", "--seed", str(2**64))])
def test_a_seed_out_of_range_names_the_option(args):
    """A seed beyond 64 bits reached torch's generator: 'Overflow when unpacking long long'."""
    line = error_line(invoke(*args), code=2)
    assert "--seed" in line and "Overflow" not in line


def test_a_usage_error_is_one_line():
    line = error_line(invoke("build", "--archh", "sm_90"), code=2)
    assert "--archh" in line and "aotattn build --help" in line


@pytest.mark.parametrize("args, words", [
    (["tuning", "show", "--arch", "sm_75"], ["sm_75", "have:"]),
    (["tuning", "show", "--table", "flash.nope"], ["flash.nope", "flash.attn_fwd"]),
    (["tuning", "diff", "--table", "flash.nope"], ["flash.nope"]),
    (["images", "extract", "/nonexistent/x.aotimg", "/tmp/never"], ["x.aotimg", "cannot read"]),
])
def test_errors_of_subcommands_are_one_line(args, words):
    line = error_line(invoke(*args))
    assert all(word in line for word in words), line


@pytest.mark.parametrize("error, base", [
    ("aotattn.tuning:TuningError", ValueError),
    ("aotattn.runtime.images:ImageError", Exception),
    ("aotattn.runtime.images:ImageMissing", Exception),
    ("aotattn.runtime.driver:DriverError", RuntimeError),
])
def test_every_layer_error_is_an_aotattn_error_printed_as_one_line(monkeypatch, error, base):
    import importlib

    from aotattn.errors import AotattnError

    module, name = error.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, AotattnError) and issubclass(cls, base)

    def failing(self, arch, table, *args, **kwargs):
        raise cls(f"{name} from the test: do this instead")

    monkeypatch.setattr(Database, "effective", failing)
    assert error_line(invoke("tuning", "show")) == f"aotattn: error: {name} from the test: do this instead"


def test_an_internal_error_is_one_line_unless_debug(monkeypatch):
    def broken(self, arch, table, *args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(Database, "effective", broken)
    line = error_line(invoke("tuning", "show"))
    assert "internal error" in line and "KeyError" in line and "--debug" in line
    result = invoke("--debug", "tuning", "show")
    assert isinstance(result.exception, KeyError)
    result = invoke("tuning", "show", env={"AOTATTN_DEBUG": "1"})
    assert isinstance(result.exception, KeyError)


# ----------------------------------------------------------------------------- --where


@pytest.mark.parametrize("where, words", [
    ("dtype=bf16 BLOCKD=128", ["BLOCKD", "BLOCK_D", "dtype"]),
    ("dtype=bfloat16", ["bfloat16", "fp16", "bf16", "fp32"]),
    ("BLOCK_D=100", ["BLOCK_D=100", "128"]),
    ("dtype", ["dtype", "axis=value"]),
    ("dtype=bf16 dtype=fp16", ["dtype", "twice"]),
])
def test_where_rejects_unknown_axes_and_values_listing_the_valid_ones(where, words):
    for args in (["build", "--dry-run", "--arch", "sm_90", "--kernel", "attn_fwd", "--where", where],
                 ["tuning", "show", "--arch", "sm_90", "--where", where]):
        line = error_line(invoke(*args))
        assert all(word in line for word in words), (args, line)
    with pytest.raises(ValueError, match=re.escape(words[0])):
        enumerate_jobs(Database(), ["sm_90"], ["flash.attn_fwd"], where)


def test_where_axes_may_belong_to_any_selected_kernel():
    """``VARLEN`` is an axis of both kernels, ``BLOCK_D`` of attn_fwd only: it filters that one."""
    jobs = enumerate_jobs(Database(), ["sm_90"], ["flash.attn_fwd", "flash.attn_bwd_preprocess"],
                          "dtype=bf16 BLOCK_D=64 BLOCK_DV=64 PAD_HEAD=False VARLEN=False MASK=0 DROPOUT=False BIAS=0")
    assert {job.table for job in jobs} == {"flash.attn_fwd", "flash.attn_bwd_preprocess"}
    assert all(job.functional["dtype"] == "bf16" for job in jobs)
    with pytest.raises(ValueError, match="BLOCK_D"):
        enumerate_jobs(Database(), ["sm_90"], ["flash.attn_bwd_preprocess"], "BLOCK_D=64")


def test_a_repeated_arch_is_built_and_counted_once():
    args = ("build", "--dry-run", "--kernel", "attn_fwd", "--where", "dtype=bf16 BLOCK_D=64 VARLEN=False")
    once, twice = invoke(*args, "--arch", "sm_90"), invoke(*args, "--arch", "sm_90", "--arch", "sm_90")
    assert once.exit_code == twice.exit_code == 0 and once.output == twice.output
    assert re.search(r"^\d+ kernel\(s\): sm_90 flash.attn_fwd \d+$", once.output.splitlines()[-1])


def test_a_where_that_matches_nothing_is_an_error():
    line = error_line(invoke("build", "--dry-run", "--arch", "sm_90", "--kernel", "attn_fwd", "--where",
                             "VARLEN=True BIAS=1"))
    assert "matches no functional" in line


# ----------------------------------------------------------------------------- images


def _one_archive(root):
    spec = families.kernels()["flash.dropout_mask"]
    entry = images.Entry(key="||generic", functional={}, config={}, variant="generic", symbol="k", shared=0,
                         num_warps=4, warp_size=32, global_scratch_size=0, global_scratch_align=1,
                         profile_scratch_size=0, binary="cubin", file="flash.dropout_mask/k.cubin", blob="")
    path = images.archive_path(root, "sm_90", spec.qualname)
    images.write_archive(path, "sm_90", spec.qualname, "3.6.0", images.source_hash(spec.module, spec.declaration),
                         [(entry, b"\x7fELF" + bytes(range(256)))])
    return path


def test_images_commands_follow_AOTATTN_IMAGES(tmp_path):
    path = _one_archive(tmp_path / "mine")
    env = {images.ENV_VAR: str(tmp_path / "mine")}
    result = invoke("images", "ls", env=env)
    assert result.exit_code == 0 and "flash.dropout_mask" in result.output
    result = invoke("images", "verify", env=env)
    assert result.exit_code == 0 and "1 archive(s), 0 problem(s)" in result.output
    path.write_bytes(path.read_bytes()[:-20])
    assert invoke("images", "verify", env=env).exit_code == 1


def test_images_commands_without_a_folder_say_so_in_one_line(tmp_path):
    env = {images.ENV_VAR: str(tmp_path / "none")}
    for command in ("ls", "verify"):
        line = error_line(invoke("images", command, env=env))
        assert "no image folder" in line and str(tmp_path / "none") in line and "aotattn build" in line
    (tmp_path / "empty").mkdir()
    line = error_line(invoke("images", "verify", str(tmp_path / "empty")))
    assert "no image archives" in line


# ----------------------------------------------------------------------------- lint


def test_lint_fails_on_a_missing_or_empty_or_garbage_database(tmp_path):
    line = error_line(invoke("tuning", "lint", "--tuning-db", str(tmp_path / "nonexistent")))
    assert "no tuning database" in line and "nonexistent" in line
    (tmp_path / "empty").mkdir()
    assert "no tables" in error_line(invoke("tuning", "lint", "--tuning-db", str(tmp_path / "empty")))
    (tmp_path / "garbage").write_bytes(b"\x00\x01garbage")
    assert "not a folder" in error_line(invoke("tuning", "lint", "--tuning-db", str(tmp_path / "garbage")))


def test_lint_reports_a_problem_once_with_every_architecture_it_affects(tmp_path, monkeypatch):
    from tests.tuning.test_tuning import HEADER, SPECS, TABLE

    monkeypatch.setattr(families, "tables", lambda: SPECS)
    broken = TABLE.replace("small*2 big", "small*2 huge").replace("seqlen_q=64: big*3", "seqlen_q=64: big*4")
    files = {"nvidia/sm_90/toy.k.txt": broken,
             "nvidia/sm_80/toy.k.txt": HEADER.format(arch="sm_80", base="#! base sm_90\n"),
             "amd/gfx942/toy.k.txt": HEADER.format(arch="gfx942", base="#! base sm_80\n")}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    result = invoke("tuning", "lint", "--tuning-db", str(tmp_path))
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if "toy.k.txt:" in line]
    assert len(lines) == 2, result.output  # both errors of the file, each once
    assert "unknown configuration 'huge'" in lines[0] and "expected 3 cells" in lines[1]
    assert all(line.endswith("(affects gfx942, sm_80, sm_90)") for line in lines), lines
    assert "2 problem(s)" in result.output


# ----------------------------------------------------------------------------- check


class _Perturb(torch.autograd.Function):
    """Scales the forward value by one factor and the gradient by another."""

    @staticmethod
    def forward(ctx, x, forward_scale, backward_scale):
        ctx.backward_scale = backward_scale
        return x * forward_scale

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.backward_scale, None, None


def _reference_attention(q, k, v, **mask):
    """A correct, fast stand-in for the kernels (float64 reference cast back)."""
    from aotattn import reference

    out, _ = reference.attention(q.double(), k.double(), v.double(), **mask)
    return out.to(q.dtype)


def _summary(result) -> str:
    return result.output.strip().splitlines()[-1]


def _errors(result) -> list[str]:
    return re.findall(r"\d\.\d\de[-+]\d+", result.output)


def test_check_reports_forward_and_backward_and_ends_with_a_summary(monkeypatch):
    monkeypatch.setattr(aotattn, "flash_attn_func", _reference_attention)
    result = invoke("check", "--device", "cpu", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"aotattn check: 16 checks on cpu \(seed 3\), all passed", _summary(result)), _summary(result)
    for part in ("out", "dq", "dk", "dv"):
        assert len(re.findall(rf"\b{part}\b", result.output)) == 4, part
    assert len(_errors(result)) == 16
    assert _errors(invoke("check", "--device", "cpu", "--seed", "3")) == _errors(result)  # seeded inputs
    assert _errors(invoke("check", "--device", "cpu", "--seed", "4")) != _errors(result)


@pytest.mark.parametrize("forward_scale, backward_scale, failed", [(1.1, 1.0, 4), (1.0, 1.5, 12)])
def test_check_fails_on_a_wrong_forward_or_backward(monkeypatch, forward_scale, backward_scale, failed):
    monkeypatch.setattr(aotattn, "flash_attn_func", lambda q, k, v, **mask: _Perturb.apply(
        _reference_attention(q, k, v, **mask), forward_scale, backward_scale))
    result = invoke("check", "--device", "cpu")
    assert result.exit_code == 1
    assert re.fullmatch(rf"aotattn check: 16 checks on cpu \(seed 0\), {failed} FAILED.*", _summary(result)), \
        _summary(result)


def test_check_passes_on_the_real_kernels():
    """The README's main job, on this machine (CPU: Triton's interpreter)."""
    result = invoke("check")
    assert result.exit_code == 0, result.output
    assert _summary(result).endswith("all passed")


@pytest.mark.parametrize("value, traceback", [("0", False), ("false", False), ("", False), ("1", True)])
def test_aotattn_debug_is_read_as_a_flag(value, traceback):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "aotattn.cli", "images", "ls", "/no/such/images"],
                          capture_output=True, text=True, env={**os.environ, "AOTATTN_DEBUG": value}, timeout=120)
    assert done.returncode != 0
    assert ("Traceback" in done.stderr) == traceback, done.stderr
