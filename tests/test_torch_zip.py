"""`ckpt_tools.write.torch_zip`: files written without torch load in real torch (plain, mmap=True, weights_only=True)
and
equal what `torch.save` writes; the files `to-universal` writes that way too."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools.read import pickle_reader, safe_load
from ckpt_tools.write import torch_zip
from ckpt_tools.ops import to_universal as U

from conftest import sample

ID = ".data/serialization_id"


def members(path: Path) -> dict[str, tuple[int, bytes]]:
    """name without the archive folder -> (offset of its local header, its bytes); checks every CRC first."""
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        return {i.filename.split("/", 1)[1]: (i.header_offset, zf.read(i)) for i in zf.infolist()}


def same_as_torch_save(ours: Path, obj, tmp: Path) -> None:
    """`ours` is what torch.save(obj) writes (saved beside under the same name), member for member and offset for
    offset; only the serialization id's digits may differ (torch derives them from a C++ string hash)."""
    ref = tmp / "torch_save" / ours.name
    ref.parent.mkdir(exist_ok=True)
    torch.save(obj, ref)
    a, b = members(ours), members(ref)
    assert list(a) == list(b)
    for name in a:
        assert a[name][0] == b[name][0], name
        if name != ID:
            assert a[name][1] == b[name][1], name
    assert len(a[ID][1]) == len(b[ID][1]) == 40 and a[ID][1].isdigit()
    assert ours.stat().st_size == ref.stat().st_size


def equal(x, y, where="obj") -> None:
    """Same types, same dict keys in the same order, tensors equal in dtype, shape, stride and value."""
    if torch.is_tensor(x):
        assert torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), where
        assert torch.equal(x, y), where
        return
    assert type(x) is type(y), (where, type(x), type(y))
    if isinstance(x, dict):
        assert list(x) == list(y), where
        for k in x:
            equal(x[k], y[k], f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y)):
            equal(a, b, f"{where}[{i}]")
    elif hasattr(x, "__dict__"):
        equal(vars(x), vars(y), f"{where}.__dict__")
    else:
        assert x == y, (where, x, y)


def loads_everywhere(path: Path, want) -> None:
    """torch.load plain, with mmap=True and with weights_only=True all give `want`."""
    equal(torch.load(path, weights_only=False), want)
    equal(torch.load(path, mmap=True, weights_only=True), want)


TENSORS = {
    "fp32_matrix": torch.randn(37, 19),
    "bf16_vector": torch.randn(1000).to(torch.bfloat16),
    "int64_scalar": torch.tensor(7),
    "empty_rows": torch.empty(0, 5),
    "big_fp16": torch.randn(300, 257).half(),  # past ZipWriter.SMALL: written from where it lies
}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_tensor_file_equals_torch_save(name, tmp_path):
    t = TENSORS[name]
    dtype = str(t.dtype).removeprefix("torch.")
    path = tmp_path / "fp32.pt"
    n = torch_zip.save(
        {"cat_dim": 0, "param": torch_zip.tensor_record(dtype, t.shape)},
        path,
        {"0": t.contiguous().view(-1).view(torch.uint8).numpy()},
    )
    assert n == t.numel() * t.element_size()
    loads_everywhere(path, {"cat_dim": 0, "param": t})
    same_as_torch_save(path, {"cat_dim": 0, "param": t}, tmp_path)


def test_tensor_from_file_ranges(tmp_path):
    """The bytes copied from two ranges of another file (one tensor split across two ZeRO partitions)."""
    t = torch.randn(4096, 33)
    src = tmp_path / "src.bin"
    raw = t.view(-1).view(torch.uint8).numpy().tobytes()
    src.write_bytes(b"x" * 100 + raw[:50_000] + b"y" * 7 + raw[50_000:])
    import os

    fd = os.open(src, os.O_RDONLY)
    try:
        ranges = [torch_zip.FileRange(fd, 100, 50_000), torch_zip.FileRange(fd, 100 + 50_000 + 7, len(raw) - 50_000)]
        path = tmp_path / "exp_avg.pt"
        torch_zip.save({"param": torch_zip.tensor_record("float32", t.shape)}, path, {"0": ranges})
    finally:
        os.close(fd)
    loads_everywhere(path, {"param": t})
    same_as_torch_save(path, {"param": t}, tmp_path)
    with pytest.raises(ValueError, match="bytes in ranges"):
        torch_zip.save({"param": torch_zip.tensor_record("float32", (2,))}, tmp_path / "bad.pt", {"0": ranges[:1]})


def test_tensors_made_when_written(tmp_path):
    """A storage given as a function: called once, when the writer reaches it, in the file's order (so a file of
    many tensors holds one at a time); the file equals torch.save's. A function that makes the wrong size fails."""
    a, b = torch.randn(300, 70), torch.arange(5000, dtype=torch.bfloat16)
    made: list[str] = []

    def make(name, t):
        def produce():
            made.append(name)
            return t.view(-1).view(torch.uint8).numpy()

        return produce

    obj = {
        "a": torch_zip.tensor_record("float32", a.shape, "0"),
        "b": torch_zip.tensor_record("bfloat16", b.shape, "1"),
    }
    path = tmp_path / "made.pt"
    n = torch_zip.save(obj, path, {"0": make("a", a), "1": make("b", b)})
    assert made == ["a", "b"] and n == a.numel() * 4 + b.numel() * 2
    loads_everywhere(path, {"a": a, "b": b})
    same_as_torch_save(path, {"a": a, "b": b}, tmp_path)
    with pytest.raises(ValueError, match="bytes made"):
        torch_zip.save({"a": torch_zip.tensor_record("float32", (3,))}, tmp_path / "bad.pt", {"0": lambda: b"12"})


def test_a_whole_deepspeed_optimizer_file_round_trips(tmp_path):
    """Every record of a real DeepSpeed optimizer file (flat fp32 partitions, Adam state, LossScaler,
    ZeroStageEnum) written back with its storages copied from the source: torch loads the same objects."""
    src = next((sample("deepspeed", "zero2_bf16") / "global_step4").glob("*_optim_states.pt"))
    out = tmp_path / "optim.pt"
    obj = pickle_reader.load(src).obj
    n = torch_zip.save(obj, out)
    assert n > 1000
    members(out)  # every CRC right
    equal(torch.load(out, weights_only=False), torch.load(src, weights_only=False))
    # weights_only=True + allowlist
    equal(safe_load.torch_load_allowlisted(out, mmap=True), safe_load.torch_load_allowlisted(src, mmap=True))


def test_to_universal_files_are_what_torch_save_writes(tmp_path):
    """Each file to-universal writes directly loads in torch every way and is, member for member, the file
    torch.save writes for the objects it holds."""
    src = sample("deepspeed", "zero2_bf16")
    U.execute(U.plan_to_universal(src, tmp_path / "u"), workers=2)
    zero = tmp_path / "u" / "global_step4_universal" / "zero"
    files = sorted(zero.rglob("*.pt"))
    assert len(files) == 29 * 4 + 1
    for f in files:
        if f.name == "optimizer_state.pt":
            members(f)
            obj = torch.load(f, weights_only=False)
            equal(safe_load.torch_load_allowlisted(f, mmap=True), obj)
            assert [g["params"] for g in obj["param_groups"]] == [[0], [1]]
            assert int(obj["optimizer_state_dict"]["state"][0]["step"]) == 4
            continue
        obj = torch.load(f, weights_only=False)
        loads_everywhere(f, obj)
        if f.name == "step.pt":
            assert obj.dtype == torch.float32 and int(obj) == 4
            continue
        assert list(obj) == ["cat_dim", "param"] and obj["param"].dtype == torch.float32
        if f.parent.name in ("wte.weight", "ln_f.bias"):
            same_as_torch_save(f, obj, tmp_path)


def test_an_unknown_global_is_not_copied(tmp_path):
    """The optimizer file's small fields go into optimizer_state.pt, which DeepSpeed loads with
    weights_only=False: a global outside the allowlist is refused rather than copied."""
    src = next((sample("deepspeed", "zero2_bf16") / "global_step4").glob("*_optim_states.pt"))
    obj = pickle_reader.load(src).obj
    obj["optimizer_state_dict"]["loss_scaler"] = pickle_reader.opaque_class("os.system")("echo hi")
    with pytest.raises(Exception, match="outside the allowlist.*os.system"):
        U._save_record(obj["optimizer_state_dict"], tmp_path / "optimizer_state.pt", src)
    assert not (tmp_path / "optimizer_state.pt").exists()
