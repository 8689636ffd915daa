"""A tracking server for a team (`make server`, `python -m gaexp.tools.server`): MLflow's server on a SQLite
store, locked whenever the network can reach it.

On the loopback (the default host) it is the plain `mlflow server`: only this machine can reach it. On
any other address it starts MLflow's basic-auth app: every request needs a user and password (MLflow
clients send MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD), the admin's password comes from
the environment (MLFLOW_AUTH_ADMIN_PASSWORD) or a file (--admin-password-file), never the command
line, and other users get `--default-permission` on what they did not create. docs/cluster.md says
how to add users and put TLS in front.

Its folder (`--root`) and all in it (the store, the artifacts, the users' password hashes) are its owner's
only: the server runs with umask 077, and what an older gaexp left readable by others is tightened at start.
A changed admin password is applied to the users' database at start.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from mlflow.tracking import MlflowClient

from gaexp import tracking

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PERMISSIONS = ["READ", "USE", "EDIT", "MANAGE", "NO_PERMISSIONS"]
MIN_PASSWORD = 12  # MLflow's own minimum for a basic-auth password


def needs_auth(host: str, auth: str) -> bool:
    """`auth` auto: locked unless `host` is the loopback; yes: always; no: refused beyond the loopback."""
    if auth == "no" and host not in LOOPBACK:
        raise ValueError(f"--auth no with --host {host}: a server other machines can reach always starts with "
                         f"authentication; valid: --auth auto or yes, or a loopback host ({', '.join(LOOPBACK)})")
    return auth == "yes" or (auth == "auto" and host not in LOOPBACK)


def admin_password(password_file: Path | None, env: dict[str, str]) -> str:
    if password_file is not None:
        try:
            password = password_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"--admin-password-file {password_file}: {e.strerror}") from None
    else:
        password = env.get("MLFLOW_AUTH_ADMIN_PASSWORD", "")
    if len(password) < MIN_PASSWORD:
        where = f"the file {password_file}" if password_file is not None else "MLFLOW_AUTH_ADMIN_PASSWORD"
        raise ValueError(f"a locked server needs the admin's password, {MIN_PASSWORD} characters or more, in "
                         f"{where} ({'empty' if not password else f'{len(password)} characters'}); set "
                         "MLFLOW_AUTH_ADMIN_PASSWORD or give --admin-password-file FILE")
    return password


def owner_only(root: Path) -> int:
    """Create `root` (its missing parents as usual) for its owner only, and take the group's and others'
    rights away from it and all in it (older versions left them readable by every user); how many files and
    folders that changed."""
    root.parent.mkdir(parents=True, exist_ok=True)
    root.mkdir(mode=0o700, exist_ok=True)
    tightened = _tighten(str(root))
    for folder, folders, files in os.walk(root):
        tightened += sum(_tighten(os.path.join(folder, name)) for name in folders + files)
    return tightened


def _tighten(path: str) -> int:
    """Owner-only `path` (a link is left alone: its target's mode is its own); 1 if that changed it."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode) or not mode & 0o077:
        return 0
    os.chmod(path, stat.S_IMODE(mode) & 0o700)
    return 1


def auth_ini(root: Path, admin: str, permission: str) -> Path:
    """The basic-auth app's settings (its users' database in `root`); the password is not written there."""
    path = root / "basic_auth.ini"
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("[mlflow]\n"
                    f"default_permission = {permission}\n"
                    f"database_uri = sqlite:///{root.resolve() / 'basic_auth.db'}\n"
                    f"admin_username = {admin}\n"
                    "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    return path


def flask_secret(root: Path) -> str:
    """The key MLflow's auth app signs its forms with, kept in `root` (owner-only) across restarts."""
    path = root / "flask_secret"
    if not path.is_file():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path.read_text().strip()


def allowed_hosts(names: str) -> str:
    """`names` (comma-separated Host headers) added to what MLflow allows by default (localhost and the
    loopback on any port, private IPs), which its `--allowed-hosts` would otherwise replace."""
    from mlflow.server.security_utils import get_default_allowed_hosts  # MLflow's own list, not a copy

    defaults = get_default_allowed_hosts()
    return ",".join(defaults + [n for n in (n.strip() for n in names.split(",")) if n and n not in defaults])


def admin_password_applied(db: Path, admin: str, password: str) -> bool:
    """Make `password` the password of the user `admin` in MLflow's users database `db`, which keeps the one of
    the server's first start; whether it changed (False also when `admin` is not there yet)."""
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore  # MLflow's own store: its hash, its checks

    store = SqlAlchemyStore()
    store.init_db(f"sqlite:///{db}")
    try:
        if not store.has_user(admin, use_primary=True) or store.authenticate_user(admin, password, use_primary=True):
            return False
        store.update_user(admin, password=password)
        return True
    finally:
        store.engine.dispose()


def command(root: Path, host: str, port: int, auth: bool, workers: int, allowed: str | None = None) -> list[str]:
    mlflow = Path(sys.executable).parent / "mlflow"
    argv = [str(mlflow)] if mlflow.is_file() else [sys.executable, "-m", "mlflow"]
    argv += ["server", "--backend-store-uri", f"sqlite:///{root.resolve() / 'mlflow.db'}",
             "--artifacts-destination", str(root.resolve() / "artifacts"), "--host", host, "--port", str(port),
             "--workers", str(workers)]
    argv += ["--allowed-hosts", allowed_hosts(allowed)] if allowed else []
    return argv + (["--app-name", "basic-auth"] if auth else [])


# MLflow's GenAI job runners (huey consumers, which `mlflow server` and `mlflow ui` start by default): 8 processes,
# about 20 s of CPU at every start, that gaexp needs none of. Off unless the environment turns them on.
NO_JOB_RUNNERS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def prepare(args: argparse.Namespace, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment, and its folder made owner-only (saying so if an older
    version's was not); ValueError: one line naming the bad setting."""
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}; valid: 1 to 65535")
    if args.default_permission not in PERMISSIONS:
        raise ValueError(f"--default-permission {args.default_permission}; valid: {', '.join(PERMISSIONS)}")
    locked = needs_auth(args.host, args.auth)
    env = {**NO_JOB_RUNNERS, **env}  # a value the caller set is kept
    if locked:
        env["MLFLOW_AUTH_ADMIN_PASSWORD"] = admin_password(args.admin_password_file, env)
        if importlib.util.find_spec("flask_wtf") is None:  # MLflow's auth app needs it (the mlflow[auth] extra)
            raise ValueError("MLflow's auth app needs Flask-WTF: pip install 'mlflow[auth]'")
    try:
        tightened = owner_only(args.root)
    except OSError as e:
        why = "not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise ValueError(f"--root {args.root}: {e.filename}: {why}; valid: a folder of yours, or a path where one "
                         "can be made") from None
    if tightened:
        print(f"{args.root.resolve()}: {tightened} file(s) and folder(s) other users could read made owner-only",
              flush=True)
    if locked:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(auth_ini(args.root, args.admin_user, args.default_permission))
        env.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", flask_secret(args.root))
    return command(args.root, args.host, args.port, locked, args.workers, args.allowed_hosts), env


# Before it becomes the server: on Linux, ask the kernel to send it SIGTERM when the process that started it dies
# (PR_SET_PDEATHSIG = 1, kept across execve), and exit if that process is already gone. A caller killed outright
# (SIGKILL, a test worker's os._exit) runs no `finally`, and the server is in a session of its own.
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   "if sys.platform == 'linux':\n"
                   "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
                   "if os.getppid() != int(sys.argv[1]):\n"
                   "    sys.exit(0)\n"
                   "os.execv(sys.argv[2], sys.argv[2:])")


@contextmanager
def running(argv: list[str], url: str, log_path: Path, what: str = "mlflow server",
            env: dict | None = None) -> Iterator[subprocess.Popen]:
    """Run a server's `argv` in its own process group (output to `log_path`; environment `env`, default this
    one's) until `url`/health answers; stop the whole group however the caller ends, and on Linux when the caller
    dies without ending (`DIE_WITH_PARENT`)."""
    argv = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), shutil.which(argv[0]) or argv[0], *argv[1:]]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not start: {log_path.read_text()[-2000:]}") from None
                time.sleep(0.5)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # its group is gone (it never started): nothing to stop,
            os.killpg(proc.pid, signal.SIGTERM)       # and the error above, with its log, is what the caller sees
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on; beyond the loopback the "
                        "server is locked (default: %(default)s)")
    parser.add_argument("--port", type=int, default=5000, help="(default: %(default)s)")
    parser.add_argument("--root", type=Path, default=Path("outputs/server"),
                        help="folder of the store, its artifacts and the users (default: %(default)s)")
    parser.add_argument("--auth", choices=["auto", "yes", "no"], default="auto",
                        help="auto: locked unless on the loopback; yes: always (default: %(default)s)")
    parser.add_argument("--admin-user", default="admin", help="the admin's user name (default: %(default)s)")
    parser.add_argument("--admin-password-file", type=Path, default=None,
                        help="a file holding the admin's password (default: MLFLOW_AUTH_ADMIN_PASSWORD)")
    parser.add_argument("--default-permission", default="EDIT",
                        help="what a user may do with experiments others created: "
                             f"{', '.join(PERMISSIONS)} (default: %(default)s; deleting needs MANAGE)")
    parser.add_argument("--workers", type=int, default=2, help="server processes (default: %(default)s)")
    parser.add_argument("--allowed-hosts", default=None, help="more names clients reach the server by, "
                        "comma-separated, as `mlflow server --allowed-hosts` takes them; added to MLflow's "
                        "default: localhost, the loopback and private IPs, on any port")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        argv_, env = prepare(args, dict(os.environ))
    except ValueError as e:
        sys.exit(f"error: {e}")
    os.umask(0o077)  # all the server creates from here on, its own and MLflow's (os.execve keeps it): owner-only
    db = args.root.resolve() / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # the store's tables, so that its tags get their index
    tracking.index_tags(db)
    locked = "--app-name" in argv_
    users = args.root.resolve() / "basic_auth.db"
    if locked and users.is_file() and admin_password_applied(users, args.admin_user, env["MLFLOW_AUTH_ADMIN_PASSWORD"]):
        where = args.admin_password_file or "MLFLOW_AUTH_ADMIN_PASSWORD"
        print(f"{args.admin_user}'s password changed to the one in {where} (the old one no longer works)", flush=True)
    print(f"MLflow server on http://{args.host}:{args.port}, store {args.root.resolve() / 'mlflow.db'}"
          + (f"; locked: users and passwords (admin: {args.admin_user})" if locked else "; open: loopback only"),
          flush=True)
    os.execve(argv_[0], argv_, env)


if __name__ == "__main__":
    main()
