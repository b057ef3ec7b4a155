"""`ckpt ARGS` for the tests in a process of its own, without paying its start-up each time.

A test that runs `ckpt` (`conftest.cli`) gets a process that is a fork of one interpreter which has already
imported `ckpt_cli.main` and torch (the server: one per test process, started on first use). The child sets the
caller's working folder, environment and stdin, points its stdout / stderr at files the caller reads back, runs
`ckpt_cli.main.main()` with the caller's arguments as `python -c "from ckpt_cli.main import main; main()" ARGS`
would, runs the atexit handlers and exits with main's code. Each call is a new process, forked from the same
untouched server, so nothing one command does reaches the next.

What it saves, measured on the suite (2 cores): `import ckpt_cli.main` is ~0.17 CPU s of every light command
(inspect, diff, set-lr ...) and torch's import ~1.2 CPU s more of every command that reads or writes tensors
(convert, export, to-universal, sync-tp, resume); the suite ran ~900 such commands.

What it does not stand in for, and where a fresh interpreter is still started:
- a start-up or import question (torch-free commands, a missing extra, the time to start): those tests build
  their own `python -c` command line;
- an environment given to one call that differs from the server's in what is read while interpreters start or
  torch is imported (`PYTHON*`, `TORCH*`, `OMP_*`, the locale, ...: `_START_UP_KEYS`) gets a fresh process; where
  the test process's own environment changed so, a new server is started with it;
- a process a test signals, watches or runs on a terminal (`test_signals`, `test_kill9`, `run_on_terminal`);
- `CKPT_TEST_FRESH_PROCESS=1` makes every call a fresh process (the suite before this server, to compare).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

#: environment keys read while an interpreter starts or torch (or a library it loads) is imported: a call whose
#: environment differs from the server's in one of them gets a fresh interpreter
_START_UP_KEYS = (
    "PYTHON",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS",
    "CUDA",
    "NCCL",
    "LD_",
    "LANG",
    "LC_",
)
#: keys that differ between calls without meaning anything to `ckpt`
_IGNORED_KEYS = ("PYTEST_CURRENT_TEST",)

SERVE = "import sys; sys.path.insert(0, sys.argv[2]); import forkserver; forkserver.serve(int(sys.argv[1]))"


# --- the server -------------------------------------------------------------------------------------------


def serve(fd: int) -> None:
    """Import what every `ckpt` call imports, then fork one child per request read from socket `fd` (one JSON
    line: argv, cwd, env, stdin / stdout / stderr paths); answer the child's pid, then its exit code (negative:
    the signal that ended it). Ends when the caller closes the socket."""
    import ckpt_cli.main  # noqa: F401  what every `ckpt` process imports
    import torch  # noqa: F401  what every command that touches tensors imports

    sock = socket.socket(fileno=fd)
    reader, writer = sock.makefile("r"), sock.makefile("w")
    for line in reader:
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(json.loads(line))  # never returns
        try:
            writer.write(f"{pid}\n")
            writer.flush()
            _, status = os.waitpid(pid, 0)
            writer.write(f"{os.waitstatus_to_exitcode(status)}\n")
            writer.flush()
        except OSError:  # the caller is gone (it gave up on a command past its timeout): the child was reaped
            return


def _child(req: dict) -> None:
    """In the forked child: become `python -c "from ckpt_cli.main import main; main()" ARGS` and exit with its
    code, running the atexit handlers as an interpreter's exit does."""
    code = 1
    try:
        for fd, path, flags in (
            (0, req["stdin"], os.O_RDONLY),
            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # TMPDIR is read again, from the caller's environment
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["-c", *req["argv"]]
        code = _run_main()
    except BaseException:  # noqa: BLE001  the child could not become the command (a missing folder): say why
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001  a closed stream: nothing more to write
                pass
        os._exit(code)


def _run_main() -> int:
    from ckpt_cli.main import main

    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  as the interpreter does: the traceback, exit 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


# --- the caller -------------------------------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.owner = os.getpid()
        self.env = dict(os.environ)
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(theirs.fileno()), str(Path(__file__).parent)],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=self.env,
        )
        theirs.close()
        self.sock = mine
        self.reader, self.writer = mine.makefile("r"), mine.makefile("w")

    def close(self) -> None:
        """End the server: it exits when its socket closes."""
        for f in (self.writer, self.reader, self.sock):
            f.close()
        self.proc.wait(timeout=60)

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a child of this server starts as a fresh interpreter with `env` would."""
        keys = (set(env) | set(self.env)) - set(_IGNORED_KEYS)
        return all(env.get(k) == self.env.get(k) for k in keys if k.startswith(_START_UP_KEYS))

    def run(self, argv: list[str], cwd: str, env: dict[str, str], stdin: str, out: str, err: str, timeout: float):
        req = {"argv": argv, "cwd": cwd, "env": env, "stdin": stdin, "stdout": out, "stderr": err}
        self.writer.write(json.dumps(req) + "\n")
        self.writer.flush()
        pid = int(self.reader.readline())
        self.sock.settimeout(timeout)
        try:
            line = self.reader.readline()
        except TimeoutError:
            # as subprocess.run's timeout: the child is killed. A socket file that timed out cannot be read
            # again, so this server ends (it reaps the child first) and the next call starts another
            os.kill(pid, signal.SIGKILL)
            self.close()
            raise subprocess.TimeoutExpired(argv, timeout) from None
        self.sock.settimeout(None)
        return int(line)


_SERVER: _Server | None = None


@atexit.register
def _close() -> None:
    """The test process ends: its server ends too, waited for (no orphan, its CPU time counted in this one's)."""
    if _SERVER is not None and _SERVER.owner == os.getpid():
        _SERVER.close()


def _server() -> _Server | None:
    """This test process's server; a new one when this process's own environment changed in a start-up key since
    the last started (an import here sets TORCHINDUCTOR_CACHE_DIR, a test sets a variable for good)."""
    global _SERVER
    if os.environ.get("CKPT_TEST_FRESH_PROCESS") == "1":
        return None
    if _SERVER is not None and _SERVER.owner == os.getpid() and not _SERVER.fits(dict(os.environ)):
        _SERVER.close()
        _SERVER = None
    if _SERVER is None or _SERVER.owner != os.getpid() or _SERVER.proc.poll() is not None:
        _SERVER = _Server()
    return _SERVER


def run(
    argv: list[str],
    *,
    cwd: str | os.PathLike,
    env: dict[str, str] | None = None,
    input: str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`subprocess.run([python, -c, "from ckpt_cli.main import main; main()", *argv], capture_output=True,
    text=True)` with stdin `input` (else empty), in a forked child of the server where that starts the same."""
    env = dict(os.environ if env is None else env)
    server = _server()
    if server is None or not server.fits(env):
        cmd = [sys.executable, "-c", "from ckpt_cli.main import main; main()", *argv]
        stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **stdin)
    with tempfile.TemporaryDirectory(prefix="ckpt-test-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")  # the child creates them
        stdin = os.devnull
        if input is not None:
            stdin = os.path.join(tmp, "stdin")
            Path(stdin).write_text(input)
        rc = server.run(argv, str(cwd), env, stdin, str(out), str(err), timeout)
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())
