"""Writing a file so that its readers see the old content or the new one, never a torn one.

Every file aotattn writes for others to read (tuning tables and patches, perfdb files, the
tuner's result files, the compile cache) goes through :func:`write_atomically`: the bytes
go to a temporary file in the same folder, named for this process and thread alone, which
is then renamed over the target. Two writers of one file (two ``tuning lint --fix``, two
builds sharing a cache) each rename a whole file of their own; the last one wins. Text is
UTF-8 whatever the locale: the readers read UTF-8.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"  # what a writer cut short (killed mid-write) may leave beside the target


def temporary_name(path: Path) -> Path:
    """A hidden name beside ``path`` that no other writer uses: ``.<name>.<pid>-<thread>-<token>.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
                          f"{TEMPORARY_SUFFIX}")


def write_atomically(path: Path | str, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file renamed into place.

    The file gets the target's permission bits when it exists, else the umask's (as
    ``open`` would give). On any failure the temporary file is removed and the target is
    left as it was."""
    path = Path(path)
    if not path.name or path.is_dir():  # "" is "."; the rename would fail late, with an odd message
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file: name the file to write", str(path))
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = None
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
