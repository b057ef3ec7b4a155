"""The processes a resume starts: launched under torchrun with the worker's environment, their events read
(`launch`), stopped with everything they started on Ctrl-C / SIGTERM, and the resume's scratch folder removed,
whatever the framework (`resume.deepspeed`, `resume.frameworks`, the sample makers)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from ..errors import CkptError
from ..write.io import Interrupted

#: what starts a worker's event line on stdout (`launch` parses them; every resume worker writes them)
RECORD_PREFIX = "CKPT_RESUME "


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for torch.distributed rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """Environment for CPU-only real-framework runs (no CUDA probing, deterministic, quiet)."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONHASHSEED="0",
    )
    return env


# Every process `ckpt` starts goes into a session of its own (a Ctrl-C at the terminal reaches `ckpt` alone,
# which then stops its children in order) and is stopped with everything it started: SIGTERM, then SIGKILL
# after STOP_GRACE_S. torchrun starts each worker in a session of its own too, so the launcher's process group
# misses them: the processes under the launcher are found through /proc (ppid) before anything is signalled,
# since a worker whose torchrun is gone belongs to init and can no longer be told apart.
STOP_GRACE_S = 5.0
_KILL_WAIT_S = 3.0  # after SIGKILL: the kernel tears the processes down (slow on a busy machine)


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time in clock ticks) from /proc/PID/stat; None when gone or no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _process_tree(root: int) -> dict[int, int]:
    """`root` and every process under it: pid -> start time (a pid reused by an unrelated process has another
    start time). {} without /proc (not Linux) or when `root` is gone."""
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in names:
        st = _proc_stat(int(name))
        if st is not None:
            children.setdefault(st[0], []).append(int(name))
            starts[int(name)] = st[2]
    if root not in starts:
        return {}
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in tree:
            tree[pid] = starts[pid]
            todo.extend(children.get(pid, ()))
    return tree


def _alive(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[1] not in "ZX" and st[2] == start  # a zombie has stopped: its parent reaps it


@contextlib.contextmanager
def deferred_signals() -> Iterator[Callable[[], bool]]:
    """Hold Ctrl-C and SIGTERM back while a cleanup runs to its end (stopping processes, removing a scratch
    folder): a second signal must not leave half of it undone. Yields `pending()`, true once one arrived; it
    is raised on leaving the block, by whatever handler is in force. Outside the main thread (which alone runs
    Python's signal handlers) nothing is held back."""
    mask = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        yield lambda: bool(signal.sigpending() & mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_process_tree(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> list[int]:
    """Stop `proc` (started with `start_new_session=True`) and every process under it, within seconds: SIGTERM
    to each and to each one's process group (what it started there, seen or not), SIGKILL to whatever is left
    after `grace` seconds; `proc` is reaped. Returns the pids still alive after that (normally none). Ctrl-C
    and SIGTERM are held back meanwhile (`deferred_signals`): one arriving skips the rest of the grace."""
    own_group = os.getpgrp()
    with deferred_signals() as pending:
        # before any signal, while every worker is still the launcher's child; a reaped launcher's pid may
        # already be another process's
        tree = _process_tree(proc.pid) if proc.poll() is None else {}

        def send(sig: signal.Signals) -> None:
            if proc.poll() is None:  # not reaped yet: proc.pid is still ours
                tree.update(_process_tree(proc.pid))
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            for pid, start in tree.items():
                if pid != proc.pid and _alive(pid, start):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        group = os.getpgid(pid)
                        if group != own_group:
                            os.killpg(group, sig)
                        os.kill(pid, sig)

        def stopped(seconds: float, hurry: bool) -> bool:
            end = time.monotonic() + seconds
            while True:
                if proc.poll() is not None and not any(_alive(p, s) for p, s in tree.items()):
                    return True
                if time.monotonic() >= end or (hurry and pending()):
                    return False
                time.sleep(0.05)

        send(signal.SIGTERM)
        if not stopped(grace, hurry=True):
            send(signal.SIGKILL)
            stopped(_KILL_WAIT_S, hurry=False)
        return [pid for pid, start in tree.items() if _alive(pid, start)]


def run_stoppable(cmd: list[str], *, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd)` with the output (stdout and stderr) captured as text, for a child that starts
    processes of its own: an interruption (Ctrl-C, SIGTERM) stops all of them (`stop_process_tree`), where
    subprocess.run would SIGKILL the child alone and leave its pool running."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


@contextlib.contextmanager
def scratch_folder(work_dir: str | os.PathLike | None, *, keep: bool = False) -> Iterator[Path]:
    """The scratch folder of one resume (worker plan, universal conversion, the processes' TMPDIR): `work_dir`,
    kept afterwards; else a new temporary `ckpt-resume-*` folder, removed afterwards unless `keep`. Removed on
    Ctrl-C / SIGTERM too; when something is left then (a process that would not stop, a folder that could not be
    removed), the interruption is re-raised as `io.Interrupted` saying what and where."""
    remove = work_dir is None and not keep
    scratch = Path(work_dir) if work_dir is not None else None
    try:
        if scratch is None:
            scratch = Path(tempfile.mkdtemp(prefix="ckpt-resume-"))
        scratch.mkdir(parents=True, exist_ok=True)
        yield scratch
    except KeyboardInterrupt as e:
        with deferred_signals():
            if remove and scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        left = [str(e)] if str(e) else []  # `_launch`: processes that did not stop
        if remove and scratch is not None and scratch.exists():
            left.append(f"the scratch folder {scratch} could not be removed")
        if left:
            raise Interrupted("resume stopped: the checkpoint was only read; " + "; ".join(left)) from e
        raise
    finally:
        if remove and scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _cpu_env() -> dict[str, str]:
    return worker_env()


def _env(device: str) -> dict[str, str]:
    if device == "cpu":
        return _cpu_env()
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cuda", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONHASHSEED="0")
    return env


class WorkerFailed(CkptError):
    """The training processes exited with an error: one line, the failing process's own error; the hint
    names the log file with the full output."""


def _torchrun_command(plan: Any, plan_file: Path, module: str) -> list[str]:
    """torchrun running `module --plan PLAN_FILE` on `plan.nproc` ranks, rendezvous on a free local port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(plan.nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        module,
        "--plan",
        str(plan_file),
    ]


def _read_events(
    proc: subprocess.Popen,
    log,
    on_event: Callable[[dict], None] | None,
    events: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    tail: collections.deque[str],
) -> None:
    """Every line of the processes' output into `log`; their event lines parsed into `events` (told to
    `on_event`) and `errors`, the other lines' last ones kept in `tail`."""
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if line.startswith(RECORD_PREFIX):
            try:
                ev = json.loads(line[len(RECORD_PREFIX) :])
            except ValueError:
                continue  # two ranks' lines interleaved: the log has it
            if ev.get("event") == "error":
                errors.append(ev)
                continue
            events.append(ev)
            if on_event:
                on_event(ev)
        else:
            tail.append(line.rstrip("\n"))


def _stop_interrupted(
    e: BaseException, timer, proc: subprocess.Popen | None, child_tmp: Path, log_path: Path | None
) -> None:
    """After a failure or an interruption while the processes ran: stop them all and remove their TMPDIR (and,
    on Ctrl-C, the log), with Ctrl-C held back; `Interrupted` naming the pids of any that would not stop. The
    caller re-raises `e` otherwise."""
    with deferred_signals():
        if timer:
            timer.cancel()
        left = stop_process_tree(proc) if proc is not None else []  # nothing may keep running
        shutil.rmtree(child_tmp, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) and log_path is not None:
            log_path.unlink(missing_ok=True)  # the user stopped it; nothing to read in a log
    if left and isinstance(e, KeyboardInterrupt):
        raise Interrupted(
            f"{len(left)} of the training processes did not stop even on SIGKILL (pids {' '.join(map(str, left))})"
        ) from e


# a rank whose peer died reports a broken connection: the root cause is another rank's own error
_PEER_ERROR = re.compile(
    r"Connection (reset|closed) by peer|remote worker|communicator was aborted|Broken pipe|"
    r"Socket Timeout|timed out|NCCL error.*remote",
    re.IGNORECASE,
)
_ERROR_LINE = re.compile(r"^\s*(?:\[[^]]*\]\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")


def _raise_failure(
    rc: int, errors: list[dict[str, Any]], tail: collections.deque[str], timed_out: bool, timeout: float, hint: str
) -> NoReturn:
    """WorkerFailed in one line, the root cause first: a timeout, a rank's own error (not a broken connection
    to a peer that died), a C++ abort, any rank's error, else the last error-like line of the output."""
    if timed_out:
        raise WorkerFailed(f"training processes did not finish within {timeout:g} s", hint=hint)
    own = [e for e in errors if not _PEER_ERROR.search(str(e.get("message", "")))]
    if own:
        first = own[0]
        raise WorkerFailed(f"rank {first.get('rank', '?')}: {first.get('message')}", hint=hint)
    aborted = [line.split("what():", 1)[1].strip() for line in tail if "what():" in line]
    if aborted:
        raise WorkerFailed(f"a training process aborted: {aborted[0]}", hint=hint)
    if errors:
        first = errors[0]
        raise WorkerFailed(f"rank {first.get('rank', '?')}: {first.get('message')}", hint=hint)
    # no error event (killed, crashed in the launcher or before the worker ran): the last error-like line
    found = [m.group(1) for m in map(_ERROR_LINE.match, tail) if m and "ChildFailedError" not in m.group(1)]
    last = found[-1] if found else (f"exit {rc}" if rc else "ended without finishing")
    raise WorkerFailed(f"training processes failed: {last}", hint=hint)


def launch(
    plan: Any, plan_file: Path, on_event: Callable[[dict], None] | None, timeout: float, module: str
) -> list[dict[str, Any]]:
    """Run the training processes (`module` under torchrun, `plan.nproc` ranks on `plan.device`; every
    framework's resume worker speaks the same `CKPT_RESUME {json}` event lines); parse their event lines. All
    other output goes to a log file outside the checkpoint (removed after a success or an interruption). A
    failure is one line: the first failing process's own error (its `error` event), naming the log file — never
    the launcher's traceback.

    The processes' TMPDIR is a folder beside `plan_file`, removed when they are gone: torchrun's
    `torchelastic_*` log folders (and any temp file a worker makes) go with it, also when they are killed.
    On Ctrl-C / SIGTERM (a KeyboardInterrupt here) torchrun and every worker are stopped
    (`stop_process_tree`) before the interruption goes on; if one could not be stopped, it is raised as
    `io.Interrupted` naming the pids."""
    cmd = _torchrun_command(plan, plan_file, module)
    events: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    tail: collections.deque[str] = collections.deque(maxlen=200)
    child_tmp = plan_file.parent / "tmp"
    env = {**_env(plan.device), "TMPDIR": str(child_tmp)}
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    timer = None
    timed_out = []
    try:
        child_tmp.mkdir(exist_ok=True)
        fd, log_name = tempfile.mkstemp(prefix="ckpt-resume-", suffix=".log")
        log_path = Path(log_name)
        with os.fdopen(fd, "w") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )

            def kill() -> None:
                timed_out.append(True)
                stop_process_tree(proc)

            timer = threading.Timer(timeout, kill)
            timer.start()
            _read_events(proc, log, on_event, events, errors, tail)
        rc = proc.wait()
    except BaseException as e:
        _stop_interrupted(e, timer, proc, child_tmp, log_path)
        raise
    timer.cancel()
    timer.join()  # a timeout's stop_process_tree, if one began, has finished
    shutil.rmtree(child_tmp, ignore_errors=True)
    done = bool(events) and events[-1].get("event") == "done"
    if rc == 0 and done:
        log_path.unlink(missing_ok=True)
        return events
    _raise_failure(rc, errors, tail, bool(timed_out), timeout, f"the full output is in {log_path}")
