"""Nothing hostile passes through ckpt into a framework: the exact allowlist (no prefix, no dotted name), the pickle
check of every resume planner (Megatron-LM's too), every writer's refusal of a hostile source (or, trusted, the
payload carried with a warning), and every writer's output scanned by an opcode walk of the test's own
(`hostile.scan`, not ckpt's reader). Each hostile copy is made here from the bundled samples; each payload
writes a marker file if anything ever runs it, and a control proves the dotted-name payloads are live."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import SAMPLES
from hostile import pickles as H
from hostile.runner import run, snapshot
from hostile.scan import file_globals


def _stack_global(module: str, name: str) -> bytes:
    return H.text(module) + H.text(name) + b"\x93"


def _proto4(path: Path) -> None:
    """Mark a torch.save zip's data.pkl as protocol 4: Python's unpickler then resolves dotted names."""
    H.rewrite_zip_pickle(path, path, lambda d: b"\x80\x04" + d[2:])


def _dotted_payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    cmd = H.text(f"touch {marker}")
    inner = b"\x80\x02" + H.call1(H.glob("os", "system"), cmd) + b"."
    return {
        "serialization_os_system": (
            H.call1(_stack_global("torch.serialization", "os.system"), cmd),
            "torch.serialization:os.system",
        ),
        "pathlib_os_system": (H.call1(_stack_global("pathlib", "os.system"), cmd), "pathlib:os.system"),
        "serialization_pickle_loads": (
            H.call1(_stack_global("torch.serialization", "pickle.loads"), b"C" + bytes([len(inner)]) + inner),
            "torch.serialization:pickle.loads",
        ),
    }


OPTIM = "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture(scope="module")
def dotted(tmp_path_factory):
    root = tmp_path_factory.mktemp("dotted")
    out = {}
    for name, (payload, shown) in _dotted_payloads(root / "marker").items():
        ck = root / name / "zero2_bf16"
        import shutil

        shutil.copytree(SAMPLES / "deepspeed" / "zero2_bf16", ck)
        H.poison_file(ck / OPTIM, payload, "setitem")
        _proto4(ck / OPTIM)
        out[name] = (ck, shown)
    return root, out


def test_dotted_payloads_are_live(dotted):
    """The control: torch.load(weights_only=False), as DeepSpeed loads the file, runs each of them."""
    root, cases = dotted
    for name, (ck, _) in cases.items():
        marker = root / "marker"
        marker.unlink(missing_ok=True)
        subprocess.run(
            [sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=False)", str(ck / OPTIM)],
            capture_output=True,
            timeout=120,
        )
        assert marker.exists(), f"{name}: the payload did not run under torch.load"
        marker.unlink()


def test_dotted_names_are_reported_and_refused(dotted):
    """Finding 1: a dotted name behind a known module is reported by inspect and stops `ckpt resume`."""
    root, cases = dotted
    for name, (ck, shown) in cases.items():
        r = run("inspect", ck)
        assert r.code == 0 and not r.traceback, (name, r.stderr)
        assert "unknown-global" in r.stdout and shown in r.stdout, (name, r.stdout[-1500:])
        r = run("resume", ck, "--steps", "1", "--device", "cpu")
        lines = r.error_lines()
        assert r.code == 2 and not r.traceback and len(lines) == 1, (name, r.stderr)
        assert shown in lines[0] and "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in lines[0], lines
        assert "--trust-pickles" in lines[0]
    assert not (root / "marker").exists()


def test_getattr_on_an_allowed_class_is_flagged(tmp_path):
    """getattr(pathlib.PosixPath, 'write_text') names only allowed globals; a full unpickler would still reach a
    file write through it. The reader flags every getattr that does not reach a listed nested class."""
    from ckpt_tools.read import pickle_reader

    f = tmp_path / "p.pkl"
    path = H.call1(H.glob("pathlib", "PosixPath"), H.text(str(tmp_path / "x")))
    write = H.glob("builtins", "getattr") + path + H.text("write_text") + H.TUPLE2 + H.REDUCE
    f.write_bytes(b"\x80\x02}" + H.text("a") + H.call1(write, H.text("owned")) + b"s.")
    unknown = pickle_reader.load(f).unknown_globals
    assert any("getattr" in u and "write_text" in u for u in unknown), unknown
    assert not (tmp_path / "x").exists()
    # the FSDP1 sample's getattr(ShardedTensor, "ProcessGroupState") stays quiet
    assert not pickle_reader.load(SAMPLES / "fsdp" / "fsdp1_sharded" / "rank0.pt").unknown_globals


# --- Megatron-LM resume (finding 2) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample,rel",
    [
        ("megatron_tp2_legacy", "iter_0000010/mp_rank_00/model_optim_rng.pt"),
        ("megatron_tp2_torch_dist", "iter_0000010/common.pt"),
    ],
)
def test_megatron_resume_checks_pickles(copy_sample, tmp_path, sample, rel):
    from ckpt_tools import open_checkpoint
    from ckpt_tools.errors import CkptError, UnsupportedCheckpoint
    from ckpt_tools.resume import frameworks

    ck_path = copy_sample("megatron_lm", sample)
    marker = tmp_path / "marker"
    H.poison_file(ck_path / rel, H.payloads(marker)["posix_system"][0], "setitem")
    r = run("resume", ck_path, "--steps", "1", "--device", "cpu")
    lines = r.error_lines()
    assert r.code == 2 and not r.traceback and len(lines) == 1, r.stderr
    assert "posix.system" in lines[0] and Path(rel).name in lines[0] and "--trust-pickles" in lines[0], lines
    ck = open_checkpoint(ck_path)
    with pytest.raises(UnsupportedCheckpoint, match="posix.system"):
        frameworks.plan_resume(ck, ck_path, steps=1, device="cpu")
    # trusted, the planner goes past the gate (to its next need: Megatron-LM's pretrain_gpt.py, or a plan)
    try:
        frameworks.plan_resume(ck, ck_path, steps=1, device="cpu", trust_pickles=True)
    except CkptError as e:
        assert "posix.system" not in str(e), e
    assert not marker.exists()


# --- writers (finding 3) ---------------------------------------------------------------------------------------

#: (sample group, name, file to poison, writer argv after the checkpoint path; OUT = a new output path)
WRITERS = [
    ("deepspeed", "zero2_bf16", "global_step4/mp_rank_00_model_states.pt", ["set-lr", "--scale", "0.5", "--yes"]),
    ("deepspeed", "zero2_bf16", "global_step4/mp_rank_00_model_states.pt", ["set-step", "--step", "9", "--yes"]),
    ("deepspeed", "zero2_bf16", "global_step4/mp_rank_00_model_states.pt", ["to-universal", "OUT"]),
    (
        "deepspeed",
        "zero2_bf16",
        "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ["convert", "OUT", "--to", "dcp"],
    ),
    ("deepspeed", "zero2_bf16", "global_step4/mp_rank_00_model_states.pt", ["export", "OUT.safetensors"]),
    ("megatron", "gpt_tp2_pp2_drifted", "global_step4/mp_rank_00_model_states.pt", ["sync-tp", "--yes"]),
    ("megatron", "gpt_tp2_pp2", "global_step4/mp_rank_01_model_states.pt", ["convert", "OUT", "--to", "megatron"]),
    (
        "megatron_lm",
        "megatron_tp2_torch_dist",
        "iter_0000010/common.pt",
        ["convert", "OUT", "--to", "megatron", "--ckpt-format", "torch"],
    ),
    (
        "megatron_lm",
        "megatron_tp2_legacy",
        "iter_0000010/mp_rank_01/model_optim_rng.pt",
        ["convert", "OUT", "--to", "megatron"],
    ),
    (
        "megatron_lm",
        "megatron_tp2_legacy",
        "iter_0000010/mp_rank_00/model_optim_rng.pt",
        ["set-lr", "--scale", "0.5", "--yes"],
    ),
    ("dcp", "torchtitan_real", ".metadata", ["set-lr", "--scale", "0.5", "--yes"]),
    ("dcp", "torchtitan_real", ".metadata", ["convert", "OUT", "--to", "megatron"]),
]


def _argv(ck: Path, rest: list[str], out: Path) -> list[str]:
    return [rest[0], str(ck), *[str(out) + a[3:] if a.startswith("OUT") else a for a in rest[1:]]]


def _hostile_copy(tmp_path: Path, group: str, name: str, rel: str, marker: Path, mode: str = "setitem") -> Path:
    import shutil

    ck = tmp_path / "src" / name
    shutil.copytree(SAMPLES / group / name, ck)
    target = ck / rel if (ck / rel).exists() else next(ck.glob(f"*/{rel}"))
    if name == "torchtitan_real":
        ck = target.parent
    H.poison_file(target, H.payloads(marker)["posix_system"][0], "prefix" if target.name == ".metadata" else mode)
    return ck


@pytest.mark.parametrize("case", range(len(WRITERS)), ids=[f"{w[1]}-{w[3][0]}-{w[3][-1]}" for w in WRITERS])
def test_writer_refuses_a_hostile_source(tmp_path, case):
    group, name, rel, rest = WRITERS[case]
    marker = tmp_path / "marker"
    ck = _hostile_copy(tmp_path, group, name, rel, marker)
    out = tmp_path / "out"
    before = snapshot(ck)
    r = run(*_argv(ck, rest, out), timeout=120)
    lines = r.error_lines()
    assert not r.traceback and not r.hung, r.traceback
    assert r.code == 2 and len(lines) == 1, (r.code, r.stderr[-2000:], r.stdout[-1000:])
    assert "posix.system" in lines[0] and Path(rel).name in lines[0] and "--trust-pickles" in lines[0], lines
    assert snapshot(ck) == before, "the source changed"
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".ckpt-staging-*"))
    assert not marker.exists()


def _scan_tree(folder: Path) -> list[str]:
    """What the test's own opcode walk finds in every file under `folder`: globals outside the allowlist."""
    from ckpt_tools.read import allowlist

    bad = []
    for f in sorted(p for p in (folder.rglob("*") if folder.is_dir() else [folder]) if p.is_file()):
        gl, names = file_globals(f)
        bad += [
            f"{f.name}: {m}.{n}"
            for m, n in gl
            if not allowlist.is_allowed(m, n) and (m, n) not in allowlist.CHECKED_CALLS
        ]
        bad += [f"{f.name}: member {n}" for n in names if ".." in n]
    return bad


@pytest.mark.parametrize("case", [2, 7], ids=["to-universal", "convert-megatron-torch"])
def test_trusted_write_carries_the_payload_with_a_warning(tmp_path, case):
    """--trust-pickles: the writer carries what it carries, says so in its result, and runs nothing."""
    group, name, rel, rest = WRITERS[case]
    marker = tmp_path / "marker"
    ck = _hostile_copy(tmp_path, group, name, rel, marker)
    out = tmp_path / "out"
    r = run(*_argv(ck, rest, out), "--trust-pickles", timeout=180)
    assert r.code == 0 and not r.traceback, (r.stderr[-2000:], r.traceback)
    assert "untrusted-pickle" in r.stdout and "posix.system" in r.stdout, r.stdout[-2000:]
    assert not marker.exists()
    if rest[0] == "to-universal":  # the model-states file is copied whole: the scan sees the payload in the output
        assert any("posix.system" in b for b in _scan_tree(out)), _scan_tree(out)


@pytest.mark.parametrize(
    "case",
    [2, 3, 6, 7, 8],
    ids=["to-universal", "convert-dcp", "pipeline-megatron", "torch_dist-megatron-torch", "legacy-megatron"],
)
def test_clean_writers_output_holds_no_unknown_global(tmp_path, case):
    """The outputs of clean sources, scanned with the independent walk: every global allowed, no foreign member."""
    group, name, rel, rest = WRITERS[case]
    src = SAMPLES / group / name
    out = tmp_path / "out"
    r = run(*_argv(src, rest, out), timeout=300)
    assert r.code == 0 and not r.traceback, (r.stderr[-2000:], r.traceback)
    written = [p for p in tmp_path.iterdir() if p.name.startswith("out")]
    assert written
    for w in written:
        assert not _scan_tree(w), _scan_tree(w)


def _add_member(path: Path, name: str, data: bytes = b"x") -> None:
    with zipfile.ZipFile(path) as zin:
        members = [(i, zin.read(i.filename)) for i in zin.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zout:
        for info, d in members:
            zout.writestr(zipfile.ZipInfo(info.filename, date_time=info.date_time), d)
        zout.writestr(zipfile.ZipInfo(name), data)
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("member", ["../../x", "archive/evil.py"])
def test_foreign_zip_member_is_refused(copy_sample, tmp_path, member):
    """A zip member torch.save never writes (a path-traversal name among them) is not copied into any output."""
    ck = copy_sample("megatron_lm", "megatron_tp2_torch_dist")
    common = ck / "iter_0000010" / "common.pt"
    _add_member(common, member)
    out = tmp_path / "out"
    r = run("convert", ck, out, "--to", "megatron", "--ckpt-format", "torch", timeout=120)
    lines = r.error_lines()
    assert r.code == 2 and len(lines) == 1 and not r.traceback, r.stderr
    assert "common.pt" in lines[0] and member in lines[0], lines
    assert not out.exists()
    r = run("set-lr", ck, "--scale", "0.5", "--dry-run")
    assert r.code == 2 and member in r.error_lines()[0], r.stderr


def test_output_check_catches_what_a_writer_would_put_in_place(tmp_path):
    """The last line of defence, on its own: a staging folder holding an unknown global or a foreign member is
    not renamed into place."""
    from ckpt_tools.errors import UnsupportedCheckpoint
    from ckpt_tools.write import io as wio

    out = tmp_path / "out"
    with pytest.raises(UnsupportedCheckpoint, match="posix.system"):
        with wio.new_folder(out) as tmp:
            (tmp / "x.pt").write_bytes(
                b"\x80\x02}" + H.text("k") + H.call1(H.glob("posix", "system"), H.text("true")) + b"s."
            )
    assert not out.exists() and not list(tmp_path.glob(".ckpt-staging-*"))
    with pytest.raises(UnsupportedCheckpoint, match=r"\.\./x"):
        with wio.new_folder(out) as tmp:
            import shutil

            shutil.copy(SAMPLES / "torch" / "plain.pt", tmp / "plain.pt")
            _add_member(tmp / "plain.pt", "../x")
    assert not out.exists()
    with wio.new_folder(out, trust_pickles=True) as tmp:
        (tmp / "x.pt").write_bytes(
            b"\x80\x02}" + H.text("k") + H.call1(H.glob("posix", "system"), H.text("true")) + b"s."
        )
    assert (out / "x.pt").exists()


def test_independent_scan_sees_what_the_reader_sees():
    """The test's walk and ckpt's reader agree on every bundled sample file (no unknown global in either)."""
    from ckpt_tools.read import allowlist

    checked = 0
    for f in sorted(SAMPLES.rglob("*")):
        if f.is_file() and f.suffix in (".pt", ".bin", ".pkl", ".pth", ".distcp", ".metadata", ".ckpt"):
            gl, names = file_globals(f)
            checked += bool(gl)
            bad = [(m, n) for m, n in gl if not allowlist.is_allowed(m, n) and (m, n) not in allowlist.CHECKED_CALLS]
            assert not bad, (f, bad)
            assert not [n for n in names if ".." in n], (f, names)
    assert checked >= 40


# --- over object storage (a real S3 server on 127.0.0.1) -------------------------------------------------------


def test_hostile_sources_over_s3(tmp_path):
    """The same checks on s3:// URLs: inspect names the global, every writer refuses, nothing runs, no mirror
    folder is left in the temp dir."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    import test_remote_s3 as S

    with S.moto_server(tmp_path / "moto.log") as endpoint:
        fs = S._fs(endpoint)
        fs.mkdir("hostile")
        marker = tmp_path / "marker"
        cases = [
            ("deepspeed", "zero2_bf16", OPTIM),
            ("megatron_lm", "megatron_tp2_torch_dist", "iter_0000010/common.pt"),
        ]
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir()
        env = S._env(endpoint, TMPDIR=str(tmpdir))
        runs = 0
        for group, name, rel in cases:
            ck = _hostile_copy(tmp_path / name, group, name, rel, marker)
            fs.put(str(ck), f"hostile/{name}", recursive=True)
            url = f"s3://hostile/{name}"
            r = S.ckpt("inspect", url, env=env, timeout=120)
            runs += 1
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
            assert "unknown-global" in r.stdout and "posix.system" in r.stdout, r.stdout[-1500:]
            writers = [
                ["to-universal", url, tmp_path / f"{name}-u"],
                ["convert", url, tmp_path / f"{name}-c", "--to", "dcp"],
                ["export", url, tmp_path / f"{name}.st"],
            ]
            if group == "megatron_lm":
                writers = writers[1:]
            for argv in writers:
                r = S.ckpt(*argv, env=env, timeout=180)
                runs += 1
                lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "|" not in ln]
                assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (argv, r.stderr[-2000:])
                assert "posix.system" in lines[0] and Path(rel).name in lines[0], lines
                assert not Path(argv[2]).exists()
        assert runs == 7
        assert not marker.exists()
        assert not list(tmpdir.glob("ckpt-remote-*")), list(tmpdir.iterdir())
