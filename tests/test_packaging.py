"""A plain install works (issue 16, item 1).

``python -m build`` makes an sdist and, from the sdist, a wheel; the wheel, installed into
a fresh virtual environment, runs the README's main job (``aotattn check``) from a folder
outside the checkout, with the tuning database and any prebuilt images found as package
data. The venv sees this machine's packages (``--system-site-packages``), so torch and
Triton are not installed again and nothing is downloaded (``--no-index``): about 40 s on
two cores, most of it the check itself (``-m "not packaging"`` leaves it out).

The build runs on a copy of the checkout's files (what git tracks or would track), so the
shared working tree gets no build/ or egg-info from it; the copy also gets one image
archive under aotattn/images, as a release that carries images would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from aotattn import families, paths
from aotattn.runtime import images
from aotattn.tuning import Database
from aotattn.tuning.database import default_root

pytestmark = pytest.mark.packaging
PROJECT = Path(__file__).resolve().parents[1]
TABLE = "flash.dropout_mask"


def run(args: list, cwd: Path, env: dict | None = None, timeout: float = 300) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def copy_checkout(target: Path) -> None:
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], PROJECT)
    for name in filter(None, listed.split("\0")):
        source = PROJECT / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def fake_image(root: Path) -> bytes:
    """One archive a release would carry: a stand-in binary for the real kernel source."""
    spec = families.kernels()[TABLE]
    config = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    binary = b"\x7fELF" + os.urandom(256)
    entry = images.Entry(key=images.entry_key({}, config, "generic"), functional={}, config=config, variant="generic",
                         symbol="dropout_mask_kernel", shared=0, num_warps=4, warp_size=32, global_scratch_size=0,
                         global_scratch_align=1, profile_scratch_size=0, binary="cubin", file=f"{TABLE}/a.cubin",
                         blob="")
    images.write_archive(images.archive_path(root, "sm_90", TABLE), "sm_90", TABLE, "3.6.0",
                         images.source_hash(spec.module, spec.declaration), [(entry, binary)])
    return binary


def build_and_install(base: Path) -> tuple[Path, Path, Path, Path, dict]:
    """(sdist, wheel, venv python, a folder outside the checkout, a clean environment)."""
    source, dist, venv, outside = base / "source", base / "dist", base / "venv", base / "elsewhere"
    copy_checkout(source)
    fake_image(source / "aotattn" / paths.IMAGES)
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "AOTATTN_TUNING_DB", "AOTATTN_IMAGES", "AOTATTN_MODE", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(base / "cache")
    # no isolation: the setuptools of this environment builds (no download); sdist, then a wheel from it
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source], base)
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], base)
    python = venv / "bin" / "python"
    # this environment's pip, installing into the venv; dependencies are the machine's (no index)
    run([python, "-m", "pip", "install", "--no-index", "--no-cache-dir", "--quiet", wheel], outside, env)
    return sdist, wheel, python, outside, env


def tuning_files() -> dict[str, bytes]:
    root = PROJECT / "tuning"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.suffix in (".txt", ".dbpatch")}


def test_a_built_wheel_installs_into_a_fresh_venv_and_runs_the_main_job_elsewhere(tmp_path):
    # one test, not several on a shared fixture: pytest-xdist would build once per worker
    sdist, wheel, python, outside, env = build_and_install(tmp_path)

    # the sdist and the wheel carry the database, byte for byte, and the wheel the images
    expected = tuning_files()
    assert len(expected) > 50
    with zipfile.ZipFile(wheel) as z:
        carried = {n[len("aotattn/tuning_db/"):]: z.read(n) for n in z.namelist() if n.startswith("aotattn/tuning_db/")}
        assert any(n.startswith(f"aotattn/{paths.IMAGES}/sm_90/") for n in z.namelist())
        assert not any("/__pycache__/" in n or n.startswith(("tuning/", "tests/")) for n in z.namelist())
    assert carried == expected
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        assert {n[len(top) + len("/tuning/"):] for n in t.getnames()
                if n.startswith(f"{top}/tuning/") and n.endswith((".txt", ".dbpatch"))} == set(expected)

    # installed, it finds both as package data, and builds into the user's cache
    code = ("import aotattn; from aotattn import paths, tuning; from aotattn.runtime import images\n"
            "print(aotattn.__file__); print(paths.checkout()); print(tuning.database().root)\n"
            "print(images.image_roots()[-1]); print(images.images_root())\n"
            "db = tuning.database(); print(len(db.effective('sm_90', 'flash.attn_fwd').blocks))\n")
    lines = run([python, "-c", code], outside, env).splitlines()
    package = Path(lines[0]).parent
    assert package.is_relative_to(python.parent.parent) and lines[1] == "None"
    assert Path(lines[2]) == package / paths.TUNING_DB and Path(lines[3]) == package / paths.IMAGES
    assert Path(lines[4]) == Path(env["XDG_CACHE_HOME"]) / "aotattn" / "images"
    assert int(lines[5]) == len(Database(PROJECT / "tuning").effective("sm_90", "flash.attn_fwd").blocks) > 0
    aotattn = python.parent / "aotattn"
    archive = package / paths.IMAGES / "sm_90" / (TABLE + images.SUFFIX)
    assert str(archive) in run([aotattn, "images", "ls"], outside, {**env, "COLUMNS": "500"})
    assert "1 archive(s), 0 problem(s)" in run([aotattn, "images", "verify"], outside, env)

    # the README's main job, from a folder outside the checkout
    out = run([aotattn, "check"], outside, env, timeout=600)
    assert "aotattn check: 16 checks on cpu (seed 0), all passed" in out, out[-2000:]
    assert not any(outside.iterdir())  # nothing written where it ran


def test_a_checkout_reads_its_own_tuning_folder_and_builds_into_its_images(monkeypatch):
    """Editable installs and clones on PYTHONPATH: no package data, the checkout's folders."""
    monkeypatch.delenv("AOTATTN_TUNING_DB", raising=False)
    monkeypatch.delenv(images.ENV_VAR, raising=False)
    assert paths.package_data(paths.TUNING_DB) is None and paths.checkout() == PROJECT
    assert paths.installed_tuning_db() == PROJECT / "tuning" == default_root()
    assert images.images_root() == PROJECT / "images" == images.image_roots()[0]
