"""`ckpt`: the command line. Mounts one module per command and maps errors to one-line messages.

Exit codes, for every command:
    0    ok
    1    a check found problems (check-tp-sync, diff, resume), and nothing else
    2    unusable input: one line names the file or folder and the fix (a folder a write needs is not
         writable, no terminal to confirm on without --yes, ...); nothing was written
    3    declined at the confirmation prompt; nothing was written
    130  interrupted (Ctrl-C, or SIGINT to ckpt's pid): one line says what was stopped, rolled back or left,
         and where
    143  terminated (SIGTERM: `kill`, `timeout`, a scheduler): the same cleanup and the same one line
    141  stdout closed early (`ckpt inspect X | head`)
Set CKPT_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import typer

from ckpt_tools.errors import CkptError
from ckpt_tools.view import checkpoint as _checkpoint

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Inspect and repair large-model training checkpoints. A checkpoint can also be read from a "
    "URL (s3://, gs://, file://, ...) by the commands that do not change it: inspect, diff and "
    "check-tp-sync, and export, convert and to-universal, which write their output to a local "
    "path; --storage-options JSON passes options to the fsspec client.",
    pretty_exceptions_enable=False,
)

from . import convert as _convert  # noqa: E402
from . import diff as _diff  # noqa: E402
from . import export as _export  # noqa: E402
from . import inspect as _inspect  # noqa: E402
from . import resume as _resume  # noqa: E402
from . import samples as _samples  # noqa: E402
from . import set_lr as _set_lr  # noqa: E402
from . import to_universal as _to_universal  # noqa: E402
from . import tp_sync as _tp_sync  # noqa: E402

_inspect.register(app)
_samples.register(app)
_to_universal.register(app)
_export.register(app)
_tp_sync.register(app)
_resume.register(app)
_set_lr.register(app)
_diff.register(app)
_convert.register(app)

from . import output  # noqa: E402

for _c in app.registered_commands:  # help that reads `PATH`, `--depth N`; a missing extra named (ckpt_cli.output)
    if _c.cls in (None, typer.core.TyperCommand):
        _c.cls = output.Command


def _print_version(value: bool) -> None:
    if value:
        from ckpt_tools import __version__

        typer.echo(f"ckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="print the version and exit"
    ),
) -> None:
    pass  # the group's own options; its help text is the Typer(help=...) above


class _Interrupted(BaseException):
    """A Ctrl-C carried past typer, which turns a KeyboardInterrupt into a silent exit 130. main() prints what
    the interrupted code said it rolled back or left (`ckpt_tools.write.io.Interrupted`), else _LEFT_ON_INTERRUPT."""


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: every path that stops, rolls back and cleans up
    on Ctrl-C (io's journal, the resume processes and scratch folders) does the same on SIGTERM."""


_SIGNALLED: list[int] = []  # the stop signals received by this run, first first


def _on_stop_signal(signum, frame) -> None:
    _SIGNALLED.append(signum)
    import signal

    raise _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _catch_stop_signals():
    """Make SIGINT and SIGTERM sent to this process (a script's `kill -INT PID`, `timeout`, a scheduler — not
    only a terminal's Ctrl-C to the whole process group) raise in the main thread, so the command stops what it
    started, rolls back and removes its temp folders before exiting 130 / 143. SIGINT is taken even where it
    was inherited ignored (a job started with `&` by a non-interactive shell ignores it: Python leaves it so).
    Returns the handlers to put back (None off the main thread, where no handler can be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, _on_stop_signal)
    return previous


def _stopped_by() -> tuple[str, int]:
    """(the word for the one line, the exit code) of an interrupted run: 128 + the first signal received."""
    import signal

    sig = _SIGNALLED[0] if _SIGNALLED else signal.SIGINT
    return ("terminated" if sig == signal.SIGTERM else "interrupted"), 128 + int(sig)


def _carry_interrupts(fn):
    @functools.wraps(fn)
    def command(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise _Interrupted(e) from e

    return command


for _command in app.registered_commands:
    _command.callback = _carry_interrupts(_command.callback)

# what a command stopped outside a write leaves (writes say what they put back: io.Interrupted)
_LEFT_ON_INTERRUPT = {
    "resume": "resume stopped: the checkpoint was only read, the training processes were stopped and the "
    "temporary scratch folder removed (a --work-dir keeps its files)",
    "to-universal": "to-universal stopped: the source was only read, and OUT is either complete or absent, never "
    "partial",
}


# typer >= 0.29 vendors click (typer._click) and does not install click itself: take the usage-error
# base class from typer's own exception hierarchy (with an older typer that uses click, that is click's class)
_CLICK_ERRORS = tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _install_test_kill_hook() -> None:
    """TEST HOOK (tests/test_kill9.py): `CKPT_TEST_KILL_AT=STAGE:N` SIGKILLs this process at the Nth
    write step named STAGE: an `io.execute` stage (produce, backup, replace, write — after each byte range
    written into a file changed in place —, verify, done) or `fsync` (every file `io` fsyncs: undo records,
    files changed in place, staged copies, a new output folder's files); `STAGE:N:INT` sends SIGINT there
    instead (a Ctrl-C: tests/test_write_safety.py). Unset, nothing changes."""
    spec = os.environ.get("CKPT_TEST_KILL_AT")
    if not spec:
        return
    import signal

    from ckpt_tools.write import io

    stage, _, rest = spec.partition(":")
    n, _, sig = rest.partition(":")
    seen = [0]

    def hit(name: str) -> None:
        if name == stage:
            seen[0] += 1
            if seen[0] == int(n or 1):
                os.kill(os.getpid(), getattr(signal, "SIG" + (sig or "KILL")))

    execute, fsync_file = io.execute, io._fsync_file

    def execute_hooked(plan, *, on_stage=None, **kw):
        def on(s, f):
            hit(s)
            if on_stage:
                on_stage(s, f)

        return execute(plan, on_stage=on, **kw)

    def fsync_hooked(p):
        fsync_file(p)
        hit("fsync")

    io.execute, io._fsync_file = execute_hooked, fsync_hooked


def _fast_parse(argv: list[str]):
    """A command is meant to answer instantly; typer >= 0.29 imports pydantic and builds a validator for every
    option when it parses (~60 ms: a third of a `check-tp-sync` or a `set-lr` run). For plain invocations,
    parse with argparse from the command's own typer declarations (names, types, defaults, lists); anything
    unusual (--help, a parse error, a value outside an option's min/max, an option type or feature this does
    not know) falls back to typer, so behaviour and messages stay typer's. Returns a callable or None."""
    import argparse
    import inspect as pyinspect
    import typing
    from pathlib import Path

    if not argv or argv[0].startswith("-") or any(a in ("--help", "-h") for a in argv):
        return None
    command = next(
        (c for c in app.registered_commands if (c.name or c.callback.__name__.replace("_", "-")) == argv[0]), None
    )
    if command is None:
        return None

    class Quiet(argparse.ArgumentParser):
        def error(self, message):  # never print: typer reports the problem in its own words
            raise ValueError(message)

    fn = pyinspect.unwrap(command.callback)
    hints = typing.get_type_hints(fn)

    def base_of(kind):  # Optional[X] -> X; anything else as it is (List[str] stays a list)
        if typing.get_origin(kind) is typing.Union:
            return next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        return kind

    parser = Quiet(add_help=False, exit_on_error=False, allow_abbrev=False)
    bounds = []
    for name, param in pyinspect.signature(fn).parameters.items():
        info, base = param.default, base_of(hints.get(name))
        if isinstance(info, typer.models.ArgumentInfo) and base in (str, Path):
            parser.add_argument(
                name, type=base, **({} if info.default is ... else {"nargs": "?", "default": info.default})
            )
            continue
        if (
            not isinstance(info, typer.models.OptionInfo)
            or info.callback
            or info.is_eager
            or info.envvar
            or getattr(info, "count", False)
            or any("/" in d for d in info.param_decls or ())
        ):
            return None
        decls = tuple(info.param_decls or ()) or ("--" + name.replace("_", "-"),)  # typer's name when none given
        if base is bool and info.default is False:
            parser.add_argument(*decls, dest=name, action="store_true", default=False)
        elif base in (str, int, float, Path):
            parser.add_argument(*decls, dest=name, type=base, default=info.default)
            bounds.append((name, getattr(info, "min", None), getattr(info, "max", None)))
        elif typing.get_origin(base) is list and typing.get_args(base) == (str,):
            parser.add_argument(*decls, dest=name, action="append", default=None)
        else:
            return None
    try:
        ns, rest = parser.parse_known_args(argv[1:])
    except (argparse.ArgumentError, ValueError):
        return None
    if rest:
        return None
    kwargs = vars(ns)
    for name, lo, hi in bounds:
        v = kwargs[name]
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            return None
    for name, param in pyinspect.signature(fn).parameters.items():  # an append option given no times:
        if kwargs[name] is None and typing.get_origin(base_of(hints.get(name))) is list:  # typer passes []
            kwargs[name] = list(param.default.default or [])
    return lambda: command.callback(**kwargs)


def tune_gc() -> None:
    """A command lives seconds to minutes and holds a checkpoint tree of up to millions of objects: full
    (oldest-generation) collections would re-traverse all of it again and again and find nothing. The young
    generations are still collected, reference counting frees everything acyclic, and a parsed tree is
    moved out of the collector's sight (`ckpt_tools.view.checkpoint.FREEZE_AFTER_PARSE`)."""
    gc.set_threshold(*gc.get_threshold()[:2], 1_000_000_000)
    _checkpoint.FREEZE_AFTER_PARSE = True


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    import signal

    _SIGNALLED.clear()
    previous = _catch_stop_signals()
    try:
        _main(argv)
    finally:
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None) -> None:
    tune_gc()
    _install_test_kill_hook()
    given = sys.argv[1:] if argv is None else argv
    urls = any("://" in a or a.startswith("--storage-options") for a in given)
    try:
        if urls:  # s3://, gs://, file://, ...: read-only commands run on a mirror fetched by ranged reads
            from . import remote as _remote

            argv = _remote.mount_urls(list(given))
        fast = _fast_parse(sys.argv[1:] if argv is None else argv)
        try:
            rc = fast() if fast else app(args=argv, standalone_mode=False)
        except typer.Exit:  # a check that found problems (exit 1) read a consistent checkpoint too
            if urls:
                _remote.check_unchanged()
            raise
        if urls:
            _remote.check_unchanged()
        if urls and given and given[0] != "inspect" and _remote.report_line():
            sys.stderr.write(f"ckpt: remote: {_remote.report_line()}\n")
        sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at interpreter exit
    except CkptError as e:
        if os.environ.get("CKPT_DEBUG"):
            raise
        sys.stderr.write(f"ckpt: error: {e.one_line()}\n")
        _exit(2)
    except ModuleNotFoundError as e:  # the fast path skips output.Command.invoke: the same one line here
        root = (e.name or "").partition(".")[0]
        if root not in output.EXTRAS or os.environ.get("CKPT_DEBUG"):
            raise
        cmd = next((a for a in given if not a.startswith("-")), None)
        sys.stderr.write(f"ckpt: error: {output.need_extra(root, what=f'ckpt {cmd}' if cmd else 'this command')}\n")
        _exit(2)
    except typer.Exit as e:
        _exit(e.exit_code)
    except RecursionError:  # a list or dict filled after it was referenced can hide its depth from the pickle walk
        if os.environ.get("CKPT_DEBUG"):
            raise
        sys.stderr.write(
            "ckpt: error: a structure in the checkpoint nests too deeply to walk (the file is corrupt "
            "or hostile; do not load it with torch.load either)\n"
        )
        _exit(2)
    except (_Interrupted, KeyboardInterrupt) as e:
        said = str(e.args[0] if isinstance(e, _Interrupted) else e)
        if not said:
            args = sys.argv[1:] if argv is None else argv
            cmd = next((a for a in args if not a.startswith("-")), "ckpt")
            said = _LEFT_ON_INTERRUPT.get(cmd, f"{cmd} stopped")
        word, code = _stopped_by()
        sys.stderr.write(f"ckpt: {word}: {said}\n")
        _exit(code)
    except typer.Abort:  # Ctrl-C (or SIGTERM) at a prompt
        sys.stderr.write("ckpt: aborted\n")
        _exit(_stopped_by()[1])
    except _CLICK_ERRORS as e:
        e.show()
        _exit(2)
    except BrokenPipeError:  # `ckpt inspect X | head`: the reader left; end quietly like a C tool (SIGPIPE)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _exit(141)
    finally:
        if urls:
            from . import remote as _remote

            _remote.finish()
    _exit(rc if isinstance(rc, int) else 0)


def _exit(code: int) -> None:
    """Exit with `code`. A command that made a torch.distributed group (`to-universal --distributed`) leaves
    it through `ckpt_tools.train.procgroup.leave`: a plain interpreter exit lets gloo abort the process. A group
    the caller made (main() called in-process) is the caller's to end. A rank of a `--nproc M` job tells the
    command that launched it its code (`output.launch_nproc`: torchrun itself exits 1 for any failure)."""
    told = os.environ.get(output.NPROC_EXIT_DIR)
    if told and output.under_torchrun():
        try:
            with open(os.path.join(told, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(str(code))
        except OSError:  # the launcher's folder is gone: it reports torchrun's own code
            pass
    if "ckpt_tools.train.procgroup" in sys.modules:
        from ckpt_tools.train import procgroup

        if procgroup.joined():
            procgroup.leave(code, barrier=code == 0)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
