"""aotattn.files.write_atomically: what every file others read goes through (tuning tables
and patches, perfdb files, tuner results, the compile cache)."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aotattn.files import write_atomically


def test_concurrent_writers_of_one_file_never_tear_it(tmp_path):
    """Each reader sees one writer's whole text. With one fixed temporary name (what
    `tuning lint --fix` used), a writer could rename a file another was still filling."""
    target = tmp_path / "table.txt"
    texts = [f"# writer {i}\n" + "".join(random.choice("abcé×\n") for _ in range(random.randint(1, 200_000)))
             for i in range(6)]
    write_atomically(target, texts[0])
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            seen.append(target.read_text(encoding="utf-8"))

    def write(text):
        for _ in range(15):
            write_atomically(target, text)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in texts]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and all(s in texts for s in seen)
    assert target.read_text(encoding="utf-8") in texts
    assert [p.name for p in tmp_path.iterdir()] == ["table.txt"]


def test_a_failed_write_leaves_the_target_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "perfdb.txt"
    target.write_bytes(b"old\n")

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="No space"):
        write_atomically(target, "new\n")
    assert target.read_bytes() == b"old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["perfdb.txt"]


def test_bytes_and_text_round_trip_and_text_is_utf8(tmp_path):
    blob = bytes(random.getrandbits(8) for _ in range(4096))
    assert write_atomically(tmp_path / "a.xz", blob).read_bytes() == blob
    text = "# réglé à la main, 3×3 µs\n"
    write_atomically(tmp_path / "b.txt", text)
    assert (tmp_path / "b.txt").read_bytes() == text.encode("utf-8")


def test_permissions_are_kept_or_follow_the_umask(tmp_path):
    """A temporary file from mkstemp is 0600: renamed over a tuning table, it would have
    made the table unreadable to the group that could read it before."""
    old = os.umask(0o022)
    try:
        fresh = write_atomically(tmp_path / "fresh.txt", "x")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        kept = tmp_path / "kept.txt"
        kept.write_text("x")
        kept.chmod(0o664)
        write_atomically(kept, "y")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o664 and kept.read_text() == "y"
    finally:
        os.umask(old)


def test_a_missing_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        write_atomically(tmp_path / "nowhere" / "x.txt", "x")
    assert not (tmp_path / "nowhere").exists()


def test_perfdb_files_are_utf8_under_a_non_utf8_locale(tmp_path):
    """perfdb files (and tuner exports, fault patches) were written in the locale's encoding
    and read as UTF-8: under LC_ALL=C without coercion a non-ASCII note failed the write."""
    project = Path(__file__).resolve().parents[1]
    script = tmp_path / "write.py"  # source files are UTF-8 whatever the locale; a command line is not
    script.write_text("""import sys
from aotattn.perfmon.perfdb import Perfdb, Record
from aotattn.perfmon.entries import declared
entry = declared()[0]
db = Perfdb(header={"tag": "t", "arch": "sm_90", "gpu": "NVIDIA H200 × 1", "date": "2026-12-05T00:00:00+00:00",
                    "tuning": "sha256:0 (réglé)"})
db.add(entry, [Record(entry.name, entry.passes[0], "aotattn", 1.0, 0.01, 1.0, 1.0, "3 µs of host time")])
db.write(sys.argv[1])
""", encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(project)}
    target = tmp_path / "sm_90" / "t.txt"
    target.parent.mkdir()
    done = subprocess.run([sys.executable, str(script), str(target)], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    from aotattn.perfmon.perfdb import Perfdb

    db = Perfdb.read(target)
    assert db.header["gpu"] == "NVIDIA H200 × 1" and db.records[0].note == "3 µs of host time"
    assert [p.name for p in target.parent.iterdir()] == ["t.txt"]


def test_lint_names_a_temporary_file_a_killed_writer_left(tmp_path):
    """A writer killed between writing its temporary file and renaming it leaves the hidden
    file beside the table, which is unharmed; lint says what it is and what to do."""
    from aotattn.files import temporary_name
    from aotattn.tuning import Database

    project = Path(__file__).resolve().parents[1]
    table = tmp_path / "nvidia/sm_90/flash.philox_words.txt"
    table.parent.mkdir(parents=True)
    table.write_bytes((project / "tuning/nvidia/sm_90/flash.philox_words.txt").read_bytes())
    left = temporary_name(table)
    left.write_text("half a tab")
    (problem,) = Database(tmp_path).lint()
    assert problem.where == str(left) and "killed mid-write" in str(problem) and "delete it" in str(problem)


def test_a_folder_is_refused_as_a_target_before_anything_is_written(tmp_path):
    """``--out ""`` (the current folder) or a folder's path ended in "PosixPath('.') has an
    empty name" or a failed rename; now one error naming it, and nothing left behind."""
    for target in (tmp_path, Path("")):
        with pytest.raises(IsADirectoryError, match="a folder, not a file"):
            write_atomically(target, "x")
    assert list(tmp_path.iterdir()) == []
