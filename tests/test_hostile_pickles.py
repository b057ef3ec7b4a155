"""Reading never executes code: hostile pickles inside otherwise valid checkpoints of every format.

Each payload writes a marker file when a real unpickler runs it; `test_payloads_are_live` proves that
with `torch.load(weights_only=False)` / `pickle.load`, so the marker checks below can fail.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES, run_cli
from hostile import pickles as H
from hostile.runner import run, snapshot


def _commands() -> set[str]:
    from ckpt_cli.main import app

    return {c.name for c in app.registered_commands}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    markers = root / "markers"
    cases = H.build_corpus(SAMPLES, root / "ckpts", markers)
    return root, markers, cases


def test_payloads_are_live(corpus):
    """The control: the unsafe loaders DO run every payload (so a missing marker below means something)."""
    root, markers, cases = corpus
    args = [a for c in cases for a in (str(c.poisoned), c.loader)]
    proc = subprocess.run(
        [sys.executable, "-c", H.CONTROL_SCRIPT, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    try:
        dead = [c.name for c in cases if not c.marker.exists()]
        assert not dead, f"payloads that did not run under torch.load/pickle.load: {dead}\n{proc.stderr[-2000:]}"
        assert len(cases) >= 30
    finally:
        for c in cases:
            c.marker.unlink(missing_ok=True)


def _check_one(c: H.Hostile, argv: list, expect: int, warn: bool = True) -> list[str]:
    before = snapshot(c.ckpt.parent)
    r = run(*argv)
    problems = []
    cmd = " ".join(map(str, argv[:1]))
    if r.traceback or r.hung:
        problems.append(f"{c.name}: {cmd}: {'hung' if r.hung else r.traceback[-800:]}")
    if c.marker.exists():
        problems.append(f"{c.name}: {cmd}: EXECUTED the payload")
    if r.code != expect:
        problems.append(f"{c.name}: {cmd}: exit {r.code} (want {expect}): {r.error_lines()[-3:]}")
    if warn and r.code == expect:
        text = re.sub(r"\s+", " ", r.stdout)
        missing = [g for g in c.globals if g not in text]
        if "unknown-global" not in text or missing:
            problems.append(f"{c.name}: {cmd}: no unknown-global warning naming {missing or c.globals}")
    if snapshot(c.ckpt.parent) != before:
        problems.append(f"{c.name}: {cmd}: wrote into the checkpoint folder")
    return problems


def test_inspect_executes_nothing_and_names_the_global(corpus):
    root, markers, cases = corpus
    problems = []
    for c in cases:
        problems += _check_one(c, ["inspect", c.ckpt], 0)
    assert not problems, "\n".join(problems)
    assert not list(markers.iterdir())


def test_check_tp_sync_executes_nothing_and_names_the_global(corpus):
    root, markers, cases = corpus
    pipe = [c for c in cases if c.kind == "pipe"]
    assert len(pipe) >= 5
    problems = []
    for c in pipe:
        problems += _check_one(c, ["check-tp-sync", c.ckpt], 0)
    assert not problems, "\n".join(problems)


def _refused(c: H.Hostile, argv: list) -> list[str]:
    """A writer given a hostile source: exit 2, one line naming the file and a global, nothing executed or written."""
    before = snapshot(c.ckpt.parent)
    r = run(*argv)
    cmd = " ".join(map(str, argv[:1]))
    problems = []
    if r.traceback or r.hung:
        problems.append(f"{c.name}: {cmd}: {'hung' if r.hung else r.traceback[-800:]}")
    if c.marker.exists():
        problems.append(f"{c.name}: {cmd}: EXECUTED the payload")
    lines = r.error_lines()
    if r.code != 2 or len(lines) != 1 or c.poisoned.name not in lines[0] or not any(g in lines[0] for g in c.globals):
        problems.append(
            f"{c.name}: {cmd}: exit {r.code}, want 2 and one line naming {c.poisoned.name} and "
            f"{c.globals}: {lines[-3:]}"
        )
    if snapshot(c.ckpt.parent) != before:
        problems.append(f"{c.name}: {cmd}: wrote into the checkpoint folder")
    return problems


def test_to_universal_dry_run_refuses_the_source(corpus, tmp_path):
    """A writer never carries a global outside the allowlist: its plan (--dry-run too) refuses the source."""
    root, markers, cases = corpus
    ds = [c for c in cases if c.kind in ("ds", "pipe")]
    assert len(ds) >= 10
    problems = []
    for c in ds:
        out = tmp_path / f"{c.name}-universal"
        extra = ["--tp-layout", "megatron"] if "noinfo" in str(c.ckpt) else []
        problems += _refused(c, ["to-universal", c.ckpt, out, "--dry-run", *extra])
        if out.exists():
            problems.append(f"{c.name}: to-universal --dry-run created {out}")
    assert not problems, "\n".join(problems)


def test_to_universal_dry_run_trusted_names_the_global(corpus, tmp_path):
    root, markers, cases = corpus
    c = next(c for c in cases if c.name == "p-os_system")
    r = run("to-universal", c.ckpt, tmp_path / "u", "--dry-run", "--trust-pickles")
    assert r.code == 0 and not r.traceback, r.stderr
    assert "untrusted-pickle" in r.stdout and all(g in r.stdout for g in c.globals), r.stdout
    assert not c.marker.exists() and not (tmp_path / "u").exists()


def test_to_universal_execute_runs_no_pickle(corpus, tmp_path):
    """The real conversion refuses before any byte is written; trusted, the optimizer file's own check (torch's
    allowlist) still refuses to copy the global into optimizer_state.pt."""
    root, markers, cases = corpus
    c = next(c for c in cases if c.name == "deep-ds-optim-param-group")
    out = tmp_path / "u"
    problems = _refused(c, ["to-universal", c.ckpt, out])
    assert not problems, "\n".join(problems)
    r = run("to-universal", c.ckpt, out, "--trust-pickles")
    assert not c.marker.exists(), "to-universal executed the pickle in the optimizer file"
    assert r.code == 2 and not r.traceback, r.stderr
    lines = r.error_lines()
    assert len(lines) == 1 and "optim_states.pt" in lines[0], lines
    assert not out.exists() and not list(tmp_path.glob(".ckpt-staging-*"))


def test_diff_executes_nothing(corpus):
    if "diff" not in _commands():
        pytest.skip("`ckpt diff` does not exist in this checkout (issue 3)")
    root, markers, cases = corpus
    problems = []
    for c in cases:
        clean = next(SAMPLES.glob(f"*/{c.ckpt.name}"), None)
        if clean is None:  # the legacy files have no clean twin
            continue
        r = run("diff", clean, c.ckpt)
        if r.traceback or r.hung or c.marker.exists() or r.code not in (0, 1):
            problems.append(f"{c.name}: diff: exit {r.code} marker={c.marker.exists()} {r.traceback or ''}")
    assert not problems, "\n".join(problems)


def test_subprocess_sample(corpus):
    """A few through a real `ckpt` process: the same result as in-process, nothing executed."""
    root, markers, cases = corpus
    picked = [c for c in cases if c.name in ("p-os_system", "deep-dcp-metadata", "legacy-import_getattr")]
    assert len(picked) == 3
    for c in picked:
        r = run_cli("inspect", c.ckpt, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr
        assert "unknown-global" in r.stdout and all(g in r.stdout for g in c.globals)
        assert not c.marker.exists()


def test_resume_refuses_unknown_globals(corpus):
    """DeepSpeed's load_checkpoint uses torch.load(weights_only=False): resume must stop before it."""
    from ckpt_tools.errors import UnsupportedCheckpoint
    from ckpt_tools.resume import frameworks as resume

    root, markers, cases = corpus
    c = next(c for c in cases if c.name == "deep-ds-optim-param-group")
    r = run("resume", c.ckpt, "--steps", "1", "--device", "cpu")
    assert r.code == 2 and not r.traceback, r.stderr
    lines = r.error_lines()
    assert len(lines) == 1 and "posix.system" in lines[0] and "--trust-pickles" in lines[0], lines
    assert not c.marker.exists()
    with pytest.raises(UnsupportedCheckpoint):
        resume.plan_resume(c.ckpt, steps=1, device="cpu")
    plan = resume.plan_resume(c.ckpt, steps=1, device="cpu", trust_pickles=True)  # plans only, launches nothing
    assert plan.nproc == 2
    # a clean checkpoint passes the gate: the frameworks' own classes are not "unknown"
    assert resume.plan_resume(SAMPLES / "deepspeed" / "zero2_bf16", steps=1, device="cpu").nproc == 2
    assert not c.marker.exists()


def test_reader_api_reports_every_global():
    """`Loaded.unknown_globals` names the hostile globals of a file with every payload in it."""
    from ckpt_tools.read import pickle_reader

    import pickle as std_pickle
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        marker = Path(d) / "m"
        f = Path(d) / "all.pkl"
        f.write_bytes(std_pickle.dumps({"a": 1}, protocol=2))
        want = set()
        for i, (code, gl) in enumerate(H.payloads(marker).values()):
            H.poison_file(f, code, "setitem", key=f"k{i}")
            want |= set(gl)
        loaded = pickle_reader.load(f)
        assert want <= set(loaded.unknown_globals), want - set(loaded.unknown_globals)
        assert loaded.obj["a"] == 1 and not marker.exists()


def test_billion_laughs_is_refused_quickly(tmp_path):
    """40 nested pairs of one memoized list: 2**40 nodes if expanded. Must stop with exit 2, not hang."""
    b = b"\x80\x02}" + H.text("a") + b"(K\x01K\x01lq\x00"
    for i in range(1, 40):
        b += b"0(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"lq" + bytes([i])
    f = tmp_path / "laughs.pkl"
    f.write_bytes(b + b"s.")
    r = run("inspect", f, timeout=60)
    assert r.code == 2 and not r.traceback and not r.hung
    assert "laughs.pkl" in r.error_lines()[0] and "expands to more than" in r.error_lines()[0]


def _chain(depth: int, base: int = 900_000) -> bytes:
    """Opcodes pushing nothing: memo[base + i] = (memo[base + i-1],) * 2, from memo[base] = (). Memo slots far
    above any the host pickle uses; the 2**depth-item tuple is memo[base + depth]."""
    put, get = (lambda i: b"r" + struct.pack("<I", base + i)), (lambda i: b"j" + struct.pack("<I", base + i))
    b = b")" + put(0) + b"0"
    for i in range(1, depth + 1):
        b += get(i - 1) + get(i - 1) + b"\x86" + put(i) + b"0"
    return b


def _top(depth: int, base: int = 900_000) -> bytes:
    return b"j" + struct.pack("<I", base + depth)


#: payloads (opcodes pushing one value) whose construction hashes exponentially shared tuples; each hangs
#: Python's own pickle.load for minutes to centuries
HASH_BOMBS = {
    "dict_key_memo": b"}" + _chain(60) + _top(60) + b"K\x01s",
    "dict_key_dup": b"})" + b"2\x86" * 60 + b"K\x01s",
    "frozenset_member": H.glob("builtins", "frozenset") + _chain(60) + b"(" + _top(60) + b"l\x85R",
    # each member below the per-tuple limit (2**19 items), 20000 references of it in one set (~90 s here)
    "frozenset_many_refs": H.glob("builtins", "frozenset") + _chain(19) + b"(" + _top(19) * 20_000 + b"l\x85R",
}


@pytest.mark.parametrize("bomb", sorted(HASH_BOMBS))
def test_hash_bombs_are_live(bomb):
    """The control: Python's own pickle.loads is still busy with each payload after 3 s."""
    data = b"\x80\x02" + HASH_BOMBS[bomb] + b"."
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
            input=data,
            capture_output=True,
            timeout=3,
        )


@pytest.mark.parametrize("bomb", sorted(HASH_BOMBS))
def test_hash_bombs_are_refused_quickly(copy_sample, bomb):
    """A few hundred bytes of shared tuples inside a real DeepSpeed file: hashing them (a dict key, a set
    member) cannot be interrupted once started, so the reader must refuse before building them. A fresh
    process with a hard timeout: a regression hangs, it does not pass."""
    ck = copy_sample("deepspeed", "zero2_bf16")
    f = ck / "global_step4" / "mp_rank_00_model_states.pt"
    H.poison_file(f, HASH_BOMBS[bomb], "setitem")
    try:
        r = run_cli("inspect", ck, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{bomb}: ckpt inspect hung")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "mp_rank_00_model_states.pt" in lines[0] and "hash bomb" in lines[0]


def test_hash_bomb_check_passes_every_sample_file():
    """No false alarm: every pickle of every sample (all formats, all frameworks) passes the expansion check."""
    from ckpt_tools.read import pickle_reader

    checked = 0
    for f in sorted(SAMPLES.rglob("*")):
        if f.is_file() and f.suffix in (".pt", ".bin", ".pkl", ".pth", ".distcp", ".metadata"):
            try:
                pickle_reader.load(f)
            except pickle_reader.NotACheckpoint:
                continue
            checked += 1
    assert checked >= 40


def test_size_allocations_are_refused(tmp_path):
    """bytes(2**36) / bytearray(2**36) would zero 64 GiB; the reader refuses a size argument."""
    for ctor in ("bytes", "bytearray"):
        f = tmp_path / f"{ctor}.pkl"
        f.write_bytes(
            b"\x80\x02}" + H.text("a") + H.call1(H.glob("builtins", ctor), b"\x8a\x05\x00\x00\x00\x00\x10") + b"s."
        )
        r = run("inspect", f)
        assert r.code == 2 and not r.traceback, r.stderr
        assert "called with a size" in r.error_lines()[0]


def test_no_silent_weights_only_false():
    """Where the product loads with torch, weights_only=True with an allowlist: never weights_only=False."""
    hits = []
    for p in sorted([*(ROOT / "ckpt_tools").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"(?<!`)weights_only\s*=\s*False", code) or re.search(
                r"torch\.load\((?![^)]*weights_only)", code
            ):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_resume_gate_scans_files_inspect_does_not_parse(tmp_path):
    """`inspect` parses one ZeRO-3 model-states file; DeepSpeed's loader unpickles every rank's. The gate
    scans them all."""
    import shutil

    from ckpt_tools.errors import UnsupportedCheckpoint
    from ckpt_tools.resume import frameworks as resume

    ck = tmp_path / "zero3_bf16"
    shutil.copytree(SAMPLES / "deepspeed" / "zero3_bf16", ck)
    marker = tmp_path / "marker"
    f = ck / "global_step4" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    H.poison_file(f, H.payloads(marker)["os_system"][0], "setitem")
    with pytest.raises(UnsupportedCheckpoint, match="zero_pp_rank_1_mp_rank_00_model_states.pt.*os.system"):
        resume.plan_resume(ck, steps=1, device="cpu")
    assert not marker.exists()
