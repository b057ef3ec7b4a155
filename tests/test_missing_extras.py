"""Without an extra, every command that needs it stops with one line naming the extra (exit 2, no traceback), on
the fast command-line path and on typer's alike; and dynamic text is never eaten as rich markup (issue 44)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, run_cli, sample

#: `ckpt` in a process where importing the named packages fails as it does when they are not installed
#: (ModuleNotFoundError), and where importlib cannot find them either (output.require looks before importing)
BLOCKED = "import sys\nfor name in {blocked!r}: sys.modules[name] = None\nfrom ckpt_cli.main import main; main()"


def ckpt_without(blocked: tuple[str, ...], *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED.format(blocked=blocked), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def line(command: str, module: str, extra: str) -> str:
    return f"ckpt: error: ckpt {command} needs {module}: pip install 'ckpt-tools[{extra}]'"


NO_HEAVY = ("torch", "deepspeed")
#: (blocked packages, argv with {drifted} / {dcp} / {zero} / {out} filled in, the one line expected)
CASES = [
    (NO_HEAVY, ("sync-tp", "{drifted}", "--dry-run"), line("sync-tp", "torch", "convert")),
    (NO_HEAVY, ("sync-tp", "{drifted}", "--method", "rank0", "--yes"), line("sync-tp", "torch", "convert")),
    (NO_HEAVY, ("set-lr", "{dcp}", "--scale", "0.5", "--dry-run"), line("set-lr", "torch", "convert")),
    (NO_HEAVY, ("set-step", "{dcp}", "--step", "3", "--dry-run"), line("set-step", "torch", "convert")),
    (NO_HEAVY, ("to-universal", "{zero}", "{out}"), line("to-universal", "torch", "convert")),
    (("deepspeed",), ("to-universal", "{zero}", "{out}"), line("to-universal", "deepspeed", "convert")),
    (NO_HEAVY, ("export", "{zero}", "{out}.safetensors"), line("export", "torch", "convert")),
    (NO_HEAVY, ("convert", "{zero}", "{out}", "--to", "dcp"), line("convert", "torch", "convert")),
    (NO_HEAVY, ("resume", "{zero}", "--steps", "1"), line("resume", "torch", "train")),
    (("deepspeed",), ("resume", "{zero}", "--steps", "1"), line("resume", "deepspeed", "train")),
    (NO_HEAVY, ("samples", "make", "{out}"), line("samples make", "torch", "train")),
]


@pytest.mark.parametrize(
    "blocked,argv,want", CASES, ids=[" ".join(a[:1] + a[2:3]) + f" -{'/'.join(b)}" for b, a, _ in CASES]
)
def test_a_missing_extra_is_one_line_naming_it(blocked, argv, want, copy_sample, tmp_path):
    paths = {
        "drifted": copy_sample("megatron", "gpt_tp2_pp2_drifted"),
        "dcp": copy_sample("fsdp", "fsdp2_dcp"),
        "zero": copy_sample("deepspeed", "zero2_bf16"),
        "out": tmp_path / "out",
    }
    before = {p: sorted(q.name for q in paths[p].rglob("*")) for p in ("drifted", "dcp", "zero")}
    proc = ckpt_without(blocked, *(a.format(**paths) for a in argv))
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [want]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.safetensors").exists()
    assert before == {p: sorted(q.name for q in paths[p].rglob("*")) for p in ("drifted", "dcp", "zero")}


def test_a_note_with_brackets_prints_whole():
    """Megatron-DeepSpeed's QKV row order, written as `[heads][q|k|v][head_dim]`, is text, not rich markup."""
    proc = run_cli("convert", sample("megatron", "gpt_tp2_pp2"), "/nonexistent/out", "--to", "megatron", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "Megatron-DeepSpeed's [heads][q|k|v][head_dim] is Megatron-core's" in " ".join(proc.stdout.split())
    proc = run_cli("convert", sample("deepspeed", "zero2_bf16"), "/nonexistent/out", "--to", "dcp", "--dry-run")
    assert "[dcp / fsdp2]" in proc.stdout
