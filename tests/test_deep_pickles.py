"""Deep pickles: a tuple nested 300,000 levels deep used as a dict key is ~300 KB, and hashing it recurses in C
without a limit: SIGSEGV in every unpickler (Python's, torch.load(weights_only=True), this reader's C one). The
inert walk (`pickle_reader.check_expansion`) bounds nesting before anything is built, on every entry point; the
controls below prove the payloads kill a real unpickler, so the refusals mean something. Over s3://, a crash also
used to leave its `ckpt-remote-*` mirror folder behind, and a key nested under another key's name broke the
mirror with a traceback.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from hostile import pickles as H

from ckpt_tools.errors import CorruptCheckpoint
from ckpt_tools.read import pickle_reader

DEPTH = 300_000
#: `((((...),),),)` DEPTH levels deep: pushes one value
DEEP_TUPLE = b")" + b"\x85" * DEPTH
#: a dict whose one key is that tuple: pushes one value, and building it hashes the key
DEEP_KEYED_DICT = b"}" + DEEP_TUPLE + b"N" + b"s"


def _deep_key(pkl: bytes) -> bytes:
    """`pkl` (a pickle whose top object is a dict) with the deep tuple set as one more key of that dict."""
    assert pkl[:1] == b"\x80" and pkl[-1:] == H.STOP
    return pkl[:-1] + DEEP_TUPLE + b"N" + b"s" + H.STOP


def _poison(ckpt: Path, rel: str) -> Path:
    f = ckpt / rel
    if f.name == ".metadata":  # a plain pickle whose top object is not a dict: a deep-keyed dict, popped again
        H.poison_file(f, DEEP_KEYED_DICT, "prefix")
    else:  # a torch.save zip whose top object is a dict: the deep tuple as a key of it
        H.rewrite_zip_pickle(f, f, _deep_key)
    return f


#: (sample group, sample name, the file the payload goes into)
TARGETS = [
    ("megatron_lm", "megatron_tp2_legacy", "iter_0000010/mp_rank_00/model_optim_rng.pt"),
    ("fsdp", "fsdp2_dcp", ".metadata"),
    ("torchtune", "torchtune_full", "recipe_state/recipe_state.pt"),
]


def _python(code: str, *args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _assert_one_line_refusal(r: subprocess.CompletedProcess, name: str, what: str = "nests more than") -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert name in lines[0] and what in lines[0], lines[0]
    return lines[0]


def test_the_payload_kills_a_real_unpickler(tmp_path):
    """The control: Python's own pickle.loads of the deep-keyed dict dies of a signal (no exception, no exit code),
    and so does torch.load(weights_only=True) of a checkpoint carrying it."""
    f = tmp_path / "deep.pkl"
    f.write_bytes(b"\x80\x02" + DEEP_KEYED_DICT + H.STOP)
    r = _python("import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())", f)
    assert r.returncode < 0, (r.returncode, r.stderr[-500:])
    src = ROOT / "sample_ckpts" / TARGETS[2][0] / TARGETS[2][1] / TARGETS[2][2]
    z = tmp_path / "recipe_state.pt"
    H.rewrite_zip_pickle(src, z, _deep_key)
    r = _python("import sys, torch; torch.load(sys.argv[1], weights_only=True)", z)
    assert r.returncode < 0, (r.returncode, r.stderr[-500:])


@pytest.mark.parametrize("group,name,rel", TARGETS, ids=[t[1] for t in TARGETS])
def test_inspect_refuses_a_deep_key_with_one_line(copy_sample, group, name, rel):
    ck = copy_sample(group, name)
    f = _poison(ck, rel)
    r = run_cli("inspect", ck, timeout=120)
    line = _assert_one_line_refusal(r, f.name)
    assert "nests more than 256 levels" in line


def test_safe_load_refuses_before_torch_load(tmp_path):
    """The allowlisted torch.load (`read.safe_load.torch_load_allowlisted`) runs the same walk first: an error, not
    a signal."""
    src = ROOT / "sample_ckpts" / TARGETS[0][0] / TARGETS[0][1] / TARGETS[0][2]
    f = tmp_path / "model_optim_rng.pt"
    H.rewrite_zip_pickle(src, f, _deep_key)
    r = _python(
        "import sys\nfrom ckpt_tools.read import safe_load\nfrom ckpt_tools.errors import CkptError\n"
        "try:\n    safe_load.torch_load_allowlisted(sys.argv[1])\nexcept CkptError as e:\n    print(e.one_line())\n"
        "    sys.exit(3)",
        f,
    )
    assert r.returncode == 3, (r.returncode, r.stderr[-1000:])
    assert "nests more than" in r.stdout and "model_optim_rng.pt" in r.stdout


def test_flat_and_wide_structures_pass(tmp_path):
    """Depth is nesting, not size: a 100,000-item list, a 100,000-key dict, appended one item at a time or in
    batches, and the walk's counts still pass; 256 levels pass, 257 do not."""
    flat = list(range(100_000))
    wide = {f"k{i}": (i, [i]) for i in range(100_000)}
    for proto in (0, 2, 4):
        data = pickle.dumps(
            {"flat": flat, "wide": wide, "keys": {(i, (i, (i,))): i for i in range(1000)}}, protocol=proto
        )
        assert pickle_reader.check_expansion(data, "wide.pkl") == len(data)
        if proto:  # the reader opens protocol 2+ files (a protocol-0 one has no signature)
            f = tmp_path / f"wide{proto}.pkl"
            f.write_bytes(data)
            obj = pickle_reader.load(f).obj
            assert obj["flat"] == flat and len(obj["wide"]) == 100_000
    for kind, nest in (("list", lambda x: [x]), ("dict", lambda x: {"k": x}), ("tuple", lambda x: (x,))):
        for depth, ok in ((255, True), (256, False)):  # the top dict is one level more
            x: object = 0
            for _ in range(depth):
                x = nest(x)
            data = pickle.dumps({"deep": x}, protocol=2)
            if ok:
                pickle_reader.check_expansion(data, "ok.pkl")
            else:
                with pytest.raises(CorruptCheckpoint, match="nests more than 256 levels"):
                    pickle_reader.check_expansion(data, "deep.pkl")


def test_depth_follows_a_container_filled_after_it_was_memoized():
    """A dict is memoized when made and filled after; a later reference (memo GET) carries the depth it was filled
    to: 200 levels memoized, then referenced under 100 more, is refused."""
    inner: object = 0
    for _ in range(200):
        inner = {"k": inner}
    x: object = [inner]  # the memo reference below: `inner` pickled once, referenced twice
    for _ in range(100):
        x = [x]
    data = pickle.dumps({"a": inner, "b": x}, protocol=2)
    with pytest.raises(CorruptCheckpoint, match="nests more than"):
        pickle_reader.check_expansion(data, "shared.pkl")


def _hidden_depth_pickle(rounds: int = 1500) -> bytes:
    """A tuple whose depth the opcodes do not show: `tuple(L)` of a list L filled after the call's argument tuple
    was built (and memoized), each round wrapping the last result 200 levels deeper: 300,000 levels in all."""

    def put(k):
        return b"r" + struct.pack("<I", k)

    def get(k):
        return b"j" + struct.pack("<I", k)

    body = H.glob("builtins", "tuple") + put(0) + H.POP + H.EMPTY_TUPLE + put(1) + H.POP
    for i in range(rounds):
        lst, args, out = 10 + 3 * i, 11 + 3 * i, 12 + 3 * i
        prev = 1 if i == 0 else out - 3
        body += H.EMPTY_LIST + put(lst)  # L
        body += get(lst) + H.TUPLE1 + put(args) + H.POP  # (L,) while L is empty
        body += get(prev) + H.TUPLE1 * 200 + H.APPEND + H.POP  # L.append(((prev,),...)) through L itself
        body += get(0) + get(args) + H.REDUCE + put(out) + H.POP  # tuple(L)
    return b"\x80\x02" + body + H.EMPTY_DICT + get(12 + 3 * (rounds - 1)) + H.NONE + H.SETITEM + H.STOP


def test_a_tuple_made_by_a_call_cannot_hide_depth(tmp_path):
    """Calls that make tuples (`tuple(x)`, `torch.Size(x)`, a tensor's size) may not take tuples in: the walk
    cannot see what a list holds when the call reads it. The control kills Python's pickle (a signal)."""
    f = tmp_path / "hidden.pkl"
    f.write_bytes(_hidden_depth_pickle())
    r = _python("import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())", f)
    assert r.returncode < 0, (r.returncode, r.stderr[-500:])
    r = run_cli("inspect", f, timeout=120)
    _assert_one_line_refusal(r, "hidden.pkl", "tuple() of items that are tuples")
    size = H.glob("torch", "Size") + H.EMPTY_LIST + H.EMPTY_TUPLE + H.APPEND + H.TUPLE1 + H.REDUCE
    g = tmp_path / "size.pkl"
    g.write_bytes(b"\x80\x02}" + H.text("s") + size + H.SETITEM + H.STOP)
    with pytest.raises(CorruptCheckpoint, match="torch.Size of items that are tuples"):
        pickle_reader.load(g)


def test_a_stream_the_walk_cannot_follow_is_refused():
    """No fall-through to the unpickler: an unknown opcode or a stream without STOP is refused by the walk."""
    with pytest.raises(CorruptCheckpoint, match="unknown opcode 0xff"):
        pickle_reader.check_expansion(b"\x80\x02}\xff.", "bad.pkl")
    with pytest.raises(CorruptCheckpoint, match="ends before its STOP"):
        pickle_reader.check_expansion(b"\x80\x02}" + H.text("k"), "cut.pkl")


# --- over s3:// (a moto server on 127.0.0.1, as in test_remote_s3.py) ------------------------------------------

_S3 = all(importlib.util.find_spec(m) is not None for m in ("moto", "s3fs", "flask", "boto3"))
if _S3:
    from test_remote_s3 import BUCKET, _env, _fs, endpoint  # noqa: F401  (endpoint: the moto server fixture)

needs_s3 = pytest.mark.skipif(not _S3, reason="needs moto[server] and s3fs (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def deep_bucket(endpoint, tmp_path_factory):  # noqa: F811
    """The bucket with a poisoned DCP checkpoint under `deep/`, a clean one under `clean/`, and a `.metadata`
    object with an object `.metadata/evil` beside it under `nested/`."""
    import shutil

    fs = _fs(endpoint)
    fs.mkdir(BUCKET)
    src = ROOT / "sample_ckpts" / "fsdp" / "fsdp2_dcp"
    work = tmp_path_factory.mktemp("deep_s3")
    deep = work / "fsdp2_dcp"
    shutil.copytree(src, deep)
    _poison(deep, ".metadata")
    fs.put(str(deep), f"{BUCKET}/deep", recursive=True)
    fs.put(str(src), f"{BUCKET}/clean", recursive=True)
    fs.put(str(src), f"{BUCKET}/nested", recursive=True)
    fs.pipe(f"{BUCKET}/nested/.metadata/evil", b"x")
    return endpoint


def _ckpt_s3(endpoint: str, tmp: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from ckpt_cli.main import main; main()", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(endpoint, TMPDIR=str(tmp)),
    )


def _mirrors(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("ckpt-remote-"))


@needs_s3
def test_deep_pickle_over_s3_one_line_and_no_mirror_left(deep_bucket, tmp_path):
    r = _ckpt_s3(deep_bucket, tmp_path, "inspect", f"s3://{BUCKET}/deep")
    line = _assert_one_line_refusal(r, ".metadata")
    assert f"s3://{BUCKET}/deep" in line  # the mirror path is spelled as the URL
    assert _mirrors(tmp_path) == []


@needs_s3
def test_orphan_mirrors_of_dead_processes_are_removed(deep_bucket, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"ckpt-remote-{dead.pid}-orphan"
    (gone / "url" / "x").mkdir(parents=True)
    (gone / "url" / "x" / "f.pt").write_bytes(b"\0" * 10)
    alive = tmp_path / f"ckpt-remote-{os.getpid()}-mine"
    alive.mkdir()
    other = tmp_path / "ckpt-remote-notapid"  # not a name this module writes: left alone
    other.mkdir()
    r = _ckpt_s3(deep_bucket, tmp_path, "inspect", f"s3://{BUCKET}/clean", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _mirrors(tmp_path) == sorted([alive.name, other.name])


@needs_s3
def test_a_key_under_another_keys_name_is_one_line(deep_bucket, tmp_path):
    r = _ckpt_s3(deep_bucket, tmp_path, "inspect", f"s3://{BUCKET}/nested")
    line = _assert_one_line_refusal(r, f"s3://{BUCKET}/nested/.metadata/evil", "cannot both be mirrored")
    assert f"s3://{BUCKET}/nested/.metadata and" in line
    assert _mirrors(tmp_path) == []


@needs_s3
def test_sigterm_removes_the_mirror_of_a_library_caller(deep_bucket, tmp_path):
    """A library caller (no CLI handler): SIGTERM while a mirror exists removes it, then ends the process as
    SIGTERM does."""
    code = (
        "import sys, time\nfrom ckpt_tools.read import remote\n"
        "m = remote.mount(sys.argv[1], {'client_kwargs': {'endpoint_url': sys.argv[2]}})\n"
        "print(m.root, flush=True)\ntime.sleep(60)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, f"s3://{BUCKET}/clean", deep_bucket],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(deep_bucket, TMPDIR=str(tmp_path)),
    )
    try:
        root = p.stdout.readline().strip()
        assert root and Path(root).is_dir(), p.stderr.read() if not root else root
        assert _mirrors(tmp_path) == [Path(root).parents[1].name]
        assert Path(root).parents[1].name.startswith(f"ckpt-remote-{p.pid}-")
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGTERM
    end = time.monotonic() + 5
    while _mirrors(tmp_path) and time.monotonic() < end:
        time.sleep(0.05)
    assert _mirrors(tmp_path) == []
