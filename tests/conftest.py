"""Shared fixtures: the committed sample checkpoints and their manifests (what the real run did), and what the suite
makes once per run and shares between pytest-xdist's workers (`fresh_sample`, `untouched_resume`, `once`).

The suite runs under pytest-xdist (pyproject's addopts: `-n auto --dist loadgroup`): the tests of a module that share
one of its module-scoped fixtures go to one worker (`pytest_collection_modifyitems` below), everything else is spread
over the workers. Run one file or test in this process with `-n 0`."""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

import forkserver

ROOT = Path(__file__).resolve().parent.parent

# One thread per process for torch's CPU kernels in the workers and in every process they start (`ckpt` commands,
# torchrun ranks): xdist already runs one worker per core, so torch's default of a thread per core in each of them
# oversubscribed the cores (sample makers and resumes set the same already: `train.processes.worker_env`).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def pytest_configure(config):
    """Bytecode for the project, once per run: the suite starts thousands of `ckpt` and worker processes, and these
    machines set PYTHONDONTWRITEBYTECODE=1, so without it each one compiles the package from source again
    (measured: 0.47 s -> 0.23 s for a process that imports the CLI and the resume and convert modules).

    The CLI is imported by its installed name, `ckpt_cli` (the `cli/` folder is not importable under it from
    the repository root): stop at once when that name is another checkout's, rather than test its CLI with this
    checkout's library."""
    import importlib.util

    spec = importlib.util.find_spec("ckpt_cli")
    where = Path(spec.origin).resolve().parent if spec and spec.origin else None
    if where != ROOT / "cli":
        raise pytest.UsageError(
            f"ckpt_cli is imported from {where or 'nowhere'}, not from this checkout's cli/: "
            f"run `pip install -e .` in {ROOT}"
        )
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), before any worker starts
        for folder in ("ckpt_tools", "cli"):
            compileall.compile_dir(ROOT / folder, quiet=1, workers=1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup`: a test that uses a fixture its own module defines with a wider scope than the test
    (a server, a conversion, a resume made once for the module) joins the module's group, so that fixture is made
    once, in one worker. (Runs before xdist's own hook, which reads the groups.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = info and any(
            d.scope != "function" and d.baseid.endswith(".py") for defs in info.name2fixturedefs.values() for d in defs
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


SAMPLES = ROOT / "sample_ckpts"


def sample(group: str, name: str) -> Path:
    """Path of a committed sample checkpoint (skips nothing: a missing sample is a failure)."""
    p = SAMPLES / group / name
    assert p.exists(), f"sample {p} is missing; regenerate with `ckpt samples make sample_ckpts --only {name}`"
    return p


def manifest(group: str, name: str) -> dict:
    return json.loads((SAMPLES / group / f"{name}.manifest.json").read_text())


# --- comparing float results of training kernels -----------------------------------------------------------
#
# The committed manifests were recorded on one machine (an Intel Xeon); the suite runs on Intel and AMD
# machines alike. CPU kernels (oneDNN/MKL code paths, vectorised reductions, bf16 matmuls) sum in a different
# order on another CPU model, so a loss computed now can differ from a recorded one in its last bits. Hence:
#   * bitwise (`--loss-tol 0`, ==) only between two runs made in the same test on this machine
#     (`fresh_sample` below regenerates the uninterrupted run here, with the same OMP_NUM_THREADS=1);
#   * against a committed manifest, a relative tolerance chosen by the dtype the model trained in.
# Measured (AMD EPYC vs the Intel-recorded manifests, 6 steps): bf16 runs differ by up to 8.5e-6 relative
# (zero2_bf16 step 6: 4.041026 vs 4.041060), fp32 runs by 2.2e-7 (accelerate_ddp step 1: 9.5e-7 abs).
# bf16 keeps 8 significant bits (unit roundoff 2**-8 = 3.9e-3), so one accumulation order more or less
# flips the rounding of single activations; averaged over every token of the batch that is ~1e-5 of the
# loss: 1e-4 leaves a 12x margin. fp32 (unit roundoff 6e-8) gets 1e-5: 45x the measured difference.
# A real regression is far larger: halving the LR moves the step-6 loss of zero2_lambdalr by 3.7e-3 relative,
# 37x the bf16 tolerance (`test_resume.py::test_halved_lr_is_reported_as_expected` sees the check fail on it).
# Counters, LRs (scheduler arithmetic in Python floats), parameter counts and shapes stay exact.
LOSS_REL_TOL = {"bfloat16": 1e-4, "float32": 1e-5}


def loss_tol(dtype: str, losses) -> float:
    """The absolute loss tolerance for comparing a run now with a committed manifest of a `dtype` model."""
    return LOSS_REL_TOL[dtype] * max(abs(x) for x in losses)


def assert_history_matches(new: list[dict], old: list[dict], dtype: str) -> None:
    """Two per-step histories ({step, loss, lr}) of the same training recipe, one recorded on another machine:
    the same steps and exactly the same LRs; each loss within LOSS_REL_TOL[dtype] of the recorded one."""
    assert [h["step"] for h in new] == [h["step"] for h in old]
    for n, o in zip(new, old):
        assert n["lr"] == o["lr"], f"step {n['step']}: lr {n['lr']} != recorded {o['lr']} (LRs are exact)"
        tol = LOSS_REL_TOL[dtype] * abs(o["loss"])
        assert abs(n["loss"] - o["loss"]) <= tol, (
            f"step {n['step']}: loss {n['loss']!r} vs recorded {o['loss']!r}: |diff| {abs(n['loss'] - o['loss']):.3g} "
            f"> {tol:.3g} ({dtype} tolerance {LOSS_REL_TOL[dtype]:g} relative)"
        )


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A folder of this run that every xdist worker sees (the run's base temp folder, not the worker's own)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / name
    folder.mkdir(exist_ok=True)
    return folder


def once(folder: Path, key: str, make):
    """`make()`'s JSON-able result, computed by the first worker that asks for `key` in `folder` and read back by
    every later caller (a file lock serialises the workers)."""
    done = folder / f"{key}.json"
    with FileLock(str(folder / f"{key}.lock")):
        if not done.exists():
            tmp = done.with_suffix(".part")
            tmp.write_text(json.dumps(make()))
            tmp.replace(done)
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def fresh_sample(tmp_path_factory):
    """`fresh_sample(name)`: the sample regenerated on this machine, once per run for all workers (the uninterrupted
    run that a resume is compared with bitwise). Returns the checkpoint path; its manifest lies beside it. The
    checkpoint is shared: copy it before changing it."""
    from ckpt_tools.samples import make_sample

    out = shared_folder(tmp_path_factory, "fresh_samples")
    return lambda name: Path(once(out, name, lambda: str(make_sample(out, name))))


#: per sample name, the edited copies `producer_runs(name)` resumes beside the untouched one, in one launch of the
#: sample's worker: edit id -> (edit, steps). `edit(ck)` changes a fresh copy `ck` of the committed sample (the CLI
#: or torch) and returns what its test asserts on (JSON-able), `{"resume": path}` among it to resume another path
#: than `ck`'s resume point; `steps`: the resume's `--steps` (None: to the end of the run). Test modules register
#: their edits at import (`resume_edit`), before any test runs, so every edit of a run shares the one launch.
RESUME_EDITS: dict[str, dict[str, tuple]] = {}


def resume_edit(names, edit_id: str, *, steps: int | None = None):
    """Decorator: register `edit(ck) -> dict` as edit `edit_id` of each sample in `names` (`RESUME_EDITS`)."""

    def register(edit):
        for name in [names] if isinstance(names, str) else names:
            assert edit_id not in RESUME_EDITS.setdefault(name, {}), (name, edit_id)
            RESUME_EDITS[name][edit_id] = (edit, steps)
        return edit

    return register


@pytest.fixture(scope="session")
def producer_runs(tmp_path_factory):
    """`producer_runs(name)`: edit id -> {"ckpt": the edited copy, "info": what its edit returned, "records":
    `producer_resume`'s records of resuming it} for the untouched copy ("untouched", with `files_changed`: whether
    the resume wrote into the checkpoint it resumed; it must not) and every edit registered for sample `name`;
    all of them resumed in one launch of the sample's worker (`producer_resumes`: each run seeded and loaded as in
    a launch of its own), once per run for every xdist worker. The copies are shared: copy one before changing it."""
    out = shared_folder(tmp_path_factory, "producer_runs")
    return lambda name: once(out, name, lambda: _resume_edits(name, out / name))


def _resume_edits(name: str, folder: Path) -> dict:
    import shutil

    from ckpt_tools.samples import get_spec

    spec = get_spec(name)
    src = sample(spec.group, spec.path)
    inner = resume_inner(spec.group, spec.path)
    runs, points, steps = {}, [], []
    for edit_id, (edit, n) in {"untouched": (None, None), **RESUME_EDITS.get(name, {})}.items():
        ck = folder / edit_id / src.name
        ck.parent.mkdir(parents=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, ck)
        info = edit(ck) if edit else {}
        runs[edit_id] = {"ckpt": str(ck), "info": info}
        points.append(Path(info.get("resume", ck / inner)))
        steps.append(n)
    untouched = Path(runs["untouched"]["ckpt"]).parent
    before = {str(p): p.stat().st_mtime_ns for p in untouched.rglob("*")}
    (folder / "records").mkdir()
    for run, records in zip(
        runs.values(), producer_resumes(name, points, folder / "records", steps=steps, timeout=600)
    ):
        run["records"] = records
    after = {str(p): p.stat().st_mtime_ns for p in untouched.rglob("*")}
    runs["untouched"]["files_changed"] = sorted(
        p for p in before.keys() | after.keys() if before.get(p) != after.get(p)
    )
    return runs


@pytest.fixture(scope="session")
def untouched_resume(producer_runs):
    """`untouched_resume(name)`: the records (`producer_resume`'s) of resuming an untouched copy of committed sample
    `name` with its own worker, made once per run (`producer_runs`, in the launch that resumes the edited copies)
    for every test that compares an edited checkpoint's resume with it; also `files_changed`: whether the resume
    wrote into the checkpoint it resumed (it must not)."""
    return lambda name: producer_runs(name)["untouched"]


def resume_inner(group: str, path: str) -> str:
    """What a producer's resume continues from inside its committed sample `group/path`: the Trainer's
    `checkpoint-N` named in its manifest, else the sample itself ("")."""
    return manifest(group, path).get("extra", {}).get("checkpoint", "") if group == "hf_trainer" else ""


def manifest_of(path: Path) -> dict:
    """The manifest beside a checkpoint made by `make_sample` (`<ckpt>.manifest.json`)."""
    return json.loads(path.with_name(path.name + ".manifest.json").read_text())


@pytest.fixture
def copy_sample(tmp_path):
    """Copy a sample into tmp_path (for tests that write or break files); returns the copied path."""
    import shutil

    def _copy(group: str, name: str) -> Path:
        src = sample(group, name)
        dst = tmp_path / group / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        return dst

    return _copy


def run_cli(
    *args, timeout: float = 300, env: dict | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """Run `ckpt ARGS...` in a process of its own (`forkserver`: a fork of an interpreter that has imported ckpt
    and torch, else a fresh one), stdin `input` (else empty), capturing output; never raises on exit codes."""
    return forkserver.run([str(a) for a in args], cwd=ROOT, env=env, input=input, timeout=timeout)


def run_on_terminal(
    *args, stream: str = "stdout", columns: int = 80, env: dict | None = None, timeout: float = 300
) -> tuple[int, str, str]:
    """Run `ckpt ARGS` with `stream` ("stdout" or "stderr") on a pseudo-terminal `columns` wide, as a person
    does; returns (exit code, everything written to the terminal, the other stream)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    streams = (
        {"stdout": slave, "stderr": subprocess.PIPE}
        if stream == "stdout"
        else {"stdout": subprocess.PIPE, "stderr": slave}
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", "from ckpt_cli.main import main; main()", *map(str, args)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env=env,
        **streams,
    )
    os.close(slave)
    seen = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its side
            break
        if not chunk:
            break
        seen.append(chunk)
    other = (proc.stderr if stream == "stdout" else proc.stdout).read().decode(errors="replace")
    proc.wait(timeout=timeout)
    os.close(master)
    return proc.returncode, b"".join(seen).decode(errors="replace"), other


def fail_at(stage: str, nth: int = 1):
    """An `io.execute` on_stage callback that raises at the `nth` (1-based) time it reaches `stage`."""
    seen = []

    def on_stage(s, f):
        if s == stage:
            seen.append(f)
            if len(seen) == nth:
                raise RuntimeError(f"injected failure at {s} {f}")

    return on_stage


def producer_resume(
    name: str, ckpt_path: Path, tmp_path: Path, *, steps: int | None = None, timeout: float = 300
) -> list[dict]:
    """Resume `ckpt_path` with sample `name`'s own worker (its --resume mode, under torchrun with the sample's
    number of ranks) and return the records of the updates it made: per update `step`, `lr` (per group, the LR
    the update used), `optimizer_step` (Adam's step after it), `loss` (rank 0's), and for accelerate_two_models
    also `lr_1`, `optimizer_step_1`, `loss_1` (the second optimizer / model)."""
    return producer_resumes(name, [ckpt_path], tmp_path, steps=steps, timeout=timeout)[0]


def producer_resumes(
    name: str, ckpt_paths: list[Path], tmp_path: Path, *, steps=None, timeout: float = 300
) -> list[list[dict]]:
    """`producer_resume` of each of `ckpt_paths`, in one launch of the worker when it takes several runs
    (`--then`: each run is its own engine or Trainer, seeded and loaded as in a launch of its own). `steps`: one
    `--steps` for all, or a list of one per path."""
    from ckpt_tools.samples import free_port, get_spec, worker_env
    from ckpt_tools.samples.workers._common import then

    spec = get_spec(name)
    each = list(steps) if isinstance(steps, (list, tuple)) else [steps] * len(ckpt_paths)
    if len(ckpt_paths) > 1 and spec.module not in MULTI_RUN_WORKERS:
        return [producer_resume(name, p, tmp_path, steps=n, timeout=timeout) for p, n in zip(ckpt_paths, each)]
    records: list[Path] = []
    for _ in ckpt_paths:
        n = 0
        while (record := Path(tmp_path) / f"{name}.resume{n}.json").exists() or record in records:
            n += 1
        records.append(record)
    argv = then(
        *(
            ["--sample", name, "--resume", str(c), "--record", str(r), *(["--steps", str(n)] if n is not None else [])]
            for c, r, n in zip(ckpt_paths, records, each)
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(spec.nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        spec.module,
        *argv,
    ]
    proc = subprocess.run(cmd, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads(r.read_text()) for r in records]


#: the sample workers that take several runs in one launch (`_common.for_each_run`)
MULTI_RUN_WORKERS = {
    f"ckpt_tools.samples.workers.{m}"
    for m in ("ds_moe", "ds_optim", "ds_unseen", "hf_trainer", "lightning_run", "dcp_layouts", "accel_multi")
}


def assert_hf_logits_equal(folder, tokens, reference, shape, *, atol: float = 1e-5) -> None:
    """transformers' model of an exported `--hf` folder (fp32, eval) gives `reference`'s logits on `tokens` within
    `atol`: the proof that an export maps a framework's model right (`reference`: that framework's own forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor(tokens)).logits
    assert hf.shape == reference.shape == shape
    assert torch.allclose(hf, reference, atol=atol, rtol=0), float((hf - reference).abs().max())
    assert float(reference.abs().max()) > 50 * atol  # not a degenerate all-zero output
