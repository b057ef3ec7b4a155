"""The writer: a field edited in a real checkpoint, the file rewritten without running its pickle, and
torch (and a DeepSpeed engine) loading exactly the old tree with the one change."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch

from ckpt_tools.read import pickle_reader as pr
from ckpt_tools.write import pickle_writer as pw
from ckpt_tools.errors import UnsupportedCheckpoint
from ckpt_tools.samples import free_port, worker_env

from conftest import SAMPLES, manifest, sample
from test_pickle_reader import _payload_class

ZIP_SAMPLES = sorted(
    p for p in SAMPLES.rglob("*") if p.suffix in (".pt", ".bin", ".pkl") and p.read_bytes()[:2] == b"PK"
)
# FSDP1 ShardedTensor files need a process group to unpickle with torch (FORMATS.md)
NEEDS_PROCESS_GROUP = {"rank0.pt", "rank1.pt"}
# Megatron-LM pickles its own enums/namespaces; megatron-core is not a dependency, so where it is absent the
# byte-for-byte equality above is the whole proof (equal bytes unpickle to equal trees)
OPTIONAL_PRODUCERS = {"megatron"}
ZERO2 = ("deepspeed", "zero2_bf16")
OPTIM0 = "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def assert_same_tree(a, b, path="obj", ptrs=None):
    """torch.load results equal: tensors by value, dtype, shape and stride, storage sharing kept; numpy
    arrays by dtype and value; every other object by type and its __dict__ (or ==)."""
    ptrs = {} if ptrs is None else ptrs
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (b.dtype, b.shape, b.stride(), b.requires_grad), path
        assert torch.equal(a, b), path
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
        assert ptrs.setdefault(pa, pb) == pb, f"{path}: storage sharing differs"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}[{k!r}]", ptrs)
        if type(a) is not dict:  # OrderedDict attributes: a state_dict's `_metadata`
            assert_same_tree(vars(a), vars(b), f"{path}.__dict__", ptrs)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]", ptrs)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert_same_tree(vars(a), vars(b), f"{path}.__dict__", ptrs)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC matches
        return {i.filename: zf.read(i) for i in zf.infolist()}


def set_lrs(tree, lr: float) -> None:
    for g in tree["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]:
        g["lr"] = lr


@pytest.mark.parametrize("path", ZIP_SAMPLES, ids=lambda p: str(p.relative_to(SAMPLES)))
def test_unedited_rewrite_is_the_same_file(path, tmp_path):
    """Re-pickling the reader's tree gives torch's own bytes back, so the whole file comes out identical."""
    out = tmp_path / path.name
    pw.rewrite_torch_zip(path, out, pr.load(path).obj)
    assert out.read_bytes() == path.read_bytes()
    if path.name in NEEDS_PROCESS_GROUP:
        return
    try:
        before = torch.load(path, weights_only=False)
    except ModuleNotFoundError as e:
        assert (e.name or "").split(".")[0] in OPTIONAL_PRODUCERS, e
        return
    assert_same_tree(before, torch.load(out, weights_only=False))


@pytest.mark.parametrize(
    "rel",
    [
        "deepspeed/zero2_bf16/" + OPTIM0,
        "deepspeed/zero3_bf16/global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "deepspeed/zero2_fp32/global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "deepspeed/zero3_bf16/global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "megatron/gpt_tp2_pp2/global_step4/mp_rank_03_model_states.pt",
        "megatron/gpt_tp2_pp2/global_step4/layer_03-model_01-model_states.pt",
        "universal/zero2_bf16_universal/global_step4_universal/zero/optimizer_state.pt",
        "universal/zero2_bf16_universal/global_step4_universal/zero/wte.weight/fp32.pt",
        "accelerate/accelerate_ddp/optimizer.bin",
        "accelerate/accelerate_ddp/scheduler.bin",
        "accelerate/accelerate_ddp/random_states_0.pkl",
        "torch/plain.pt",
    ],
)
def test_edited_rewrite_loads_the_same_tree_but_the_edit(rel, tmp_path):
    """A marker key added at the top level makes the pickle differ; everything else must load as before,
    with the tensor members byte-identical and torch.Size values still torch.Size."""
    src = SAMPLES / rel
    tree = pr.load(src).obj
    tree["ckpt_marker"] = 1
    out = tmp_path / src.name
    pw.rewrite_torch_zip(src, out, tree)
    old, new = torch.load(src, weights_only=False), torch.load(out, weights_only=False)
    assert new.pop("ckpt_marker") == 1
    assert_same_tree(old, new)
    before, after = members(src), members(out)
    pkl = next(n for n in before if n.endswith("/data.pkl"))
    assert list(before) == list(after) and before[pkl] != after[pkl]
    assert all(before[n] == after[n] for n in before if n != pkl)
    if "param_shapes" in old:
        assert all(type(s) is torch.Size for group in new["param_shapes"] for s in group.values())


def test_lr_edit_in_bf16_optim_file(tmp_path):
    src = sample(*ZERO2) / OPTIM0
    tree = pr.load(src).obj
    set_lrs(tree, 1.25e-4)
    out = tmp_path / "optim.pt"
    reports = []
    pw.rewrite_torch_zip(src, out, tree, progress=lambda done, total: reports.append((done, total)))
    assert reports[-1][0] == reports[-1][1] == sum(len(v) for v in members(out).values())
    old, new = torch.load(src, weights_only=False), torch.load(out, weights_only=False)
    groups = new["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [g["lr"] for g in groups] == [1.25e-4, 1.25e-4]
    set_lrs(old, 1.25e-4)
    assert_same_tree(old, new)  # every tensor, the loss scaler, the fragment addresses: unchanged
    # the reader sees the edit too, and torch's offset-calculating mmap load agrees with the layout
    assert [g["lr"] for g in pr.load(out).obj["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]] == [
        1.25e-4,
        1.25e-4,
    ]
    from torch.utils.serialization import config

    saved = config.load.calculate_storage_offsets
    config.load.calculate_storage_offsets = True
    try:
        assert_same_tree(new, torch.load(out, weights_only=False, mmap=True))
    finally:
        config.load.calculate_storage_offsets = saved


ENGINE_SCRIPT = textwrap.dedent("""
    import copy, json, sys
    import deepspeed
    from ckpt_tools.samples.workers import _common as c
    from ckpt_tools.samples.workers.ds_zero import VARIANTS, ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    model = c.build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=c.param_groups(model),
                                           config=ds_config(VARIANTS["zero2_bf16"], c.world_size()))
    path, client = engine.load_checkpoint(sys.argv[1])
    if c.rank() == 0:
        print("RESULT " + json.dumps({"path": path, "global_steps": engine.global_steps,
                                      "lrs": c.current_lrs(engine.optimizer),
                                      "adam_step": c.adam_step(engine.optimizer)}))
    c.shutdown()
""")


def test_deepspeed_engine_resumes_with_the_edited_lr(copy_sample, tmp_path):
    """The real proof: DeepSpeed (2 CPU ranks, as the sample was saved) loads the rewritten optim files."""
    ckpt = copy_sample(*ZERO2)
    expected = [lr / 2 for lr in manifest(*ZERO2)["lr"]["param_groups"]]
    for rank in (0, 1):
        f = ckpt / f"global_step4/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        tree = pr.load(f).obj
        for g, lr in zip(tree["optimizer_state_dict"]["base_optimizer_state"]["param_groups"], expected):
            g["lr"] = lr
        staged = tmp_path / f"staged_{rank}.pt"  # outside the checkpoint, then renamed over the original
        pw.rewrite_torch_zip(f, staged, tree)
        os.replace(staged, f)
    script = tmp_path / "load_engine.py"
    script.write_text(ENGINE_SCRIPT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(script),
            str(ckpt),
        ],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["path"] is not None and result["global_steps"] == 4 and result["adam_step"] == 4
    assert result["lrs"] == expected and expected != manifest(*ZERO2)["lr"]["param_groups"]


def test_zero_to_fp32_reads_an_edited_model_states_file(copy_sample, tmp_path):
    """DeepSpeed's own consolidation calls .numel() on param_shapes values: they must stay torch.Size."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = copy_sample(*ZERO2)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    f = ckpt / "global_step4/mp_rank_00_model_states.pt"
    tree = pr.load(f).obj
    tree["global_samples"] += 1
    pw.rewrite_torch_zip(f, tmp_path / "ms.pt", tree)
    os.replace(tmp_path / "ms.pt", f)
    assert torch.load(f, weights_only=False)["global_samples"] == tree["global_samples"]
    assert_same_tree(reference, get_fp32_state_dict_from_zero_checkpoint(str(ckpt)))


class Plain:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Plain and vars(other) == vars(self)


class Slots:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __eq__(self, other):
        return type(other) is Slots and (other.a, other.b) == (self.a, self.b)


@pytest.mark.parametrize("protocol", [1, 2])
def test_python_objects_load_back_as_they_were(protocol):
    """Every kind of object the reader records, pickled back and loaded by the real pickle: same types,
    same values (protocol 1 builds objects with copyreg._reconstructor, protocol 2 with NEWOBJ)."""
    od = collections.OrderedDict(a=1)
    od.extra = "attr"
    value = {
        "plain": Plain([1, 2]),
        "set": {1, 2},
        "frozen": frozenset({3}),
        "bytes": b"\x00\xff",
        "empty": b"",
        "bytearray": bytearray(b"ab"),
        "complex": 1 + 2j,
        "slice": slice(1, 5, 2),
        "od": od,
        "defaultdict": collections.defaultdict(int, k=2),
        "counter": collections.Counter("aab"),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "np_float": np.float64(1.5),
        "np_int": np.int32(-3),
        "np_array": np.arange(6, dtype=np.int16).reshape(2, 3),
    }
    if protocol == 2:
        value["slots"] = Slots(1, "b")  # protocol 1 cannot pickle __slots__ objects at all
    tree = pr._unpickle(pickle.dumps(value, protocol=protocol), None, None, "mem")[0]
    back = pickle.loads(pw.dumps(tree))
    assert list(back) == list(value)
    for key, v in value.items():
        assert type(back[key]) is type(v), key
        assert np.array_equal(back[key], v) if key == "np_array" else back[key] == v, key
    assert back["od"].extra == "attr" and back["defaultdict"]["missing"] == 0


def test_hostile_global_survives_as_the_same_inert_call(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.arange(4.0), "x": _payload_class(marker)(), "lr": 0.1}, src)
    tree = pr.load(src).obj
    tree["lr"] = 0.05
    out = tmp_path / "rewritten.pt"
    pw.rewrite_torch_zip(src, out, tree)
    assert not marker.exists()  # neither reading nor writing ran it
    again = pr.load(out)
    payload = again.obj["x"]
    assert isinstance(payload, pr.Opaque) and payload.cls == tree["x"].cls and payload.args == (f"touch {marker}",)
    assert again.obj["lr"] == 0.05 and again.unknown_globals == pr.load(src).unknown_globals
    # it is still the live call it was: torch.load without weights_only runs it, as it would the original
    torch.load(out, weights_only=False)
    assert marker.exists()


def test_legacy_format_is_refused(tmp_path):
    src = tmp_path / "legacy.pt"
    torch.save({"a": torch.zeros(3)}, src, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedCheckpoint, match="legacy"):
        pw.rewrite_torch_zip(src, tmp_path / "out.pt", pr.load(src).obj)
    assert not (tmp_path / "out.pt").exists()


def test_tensors_built_by_hand_use_torchs_standard_calls(tmp_path):
    """A TensorRef without the recorded rebuild call (made by code, not read) is written the way
    torch.save writes a plain tensor or a Parameter."""
    src = tmp_path / "t.pt"
    sd = {
        "w": torch.randn(3, 4),
        "p": torch.nn.Parameter(torch.arange(6.0)),
        "v": torch.arange(10)[2:7],
        "shared": None,
    }
    sd["shared"] = sd["w"][1]
    torch.save(sd, src)
    tree = pr.load(src).obj
    tree = {k: dataclasses.replace(v, pickled=None) for k, v in tree.items()}
    out = tmp_path / "out.pt"
    pw.rewrite_torch_zip(src, out, tree)
    assert_same_tree(torch.load(src, weights_only=False), torch.load(out, weights_only=False))


def test_edited_tensor_metadata_is_refused_with_its_path(tmp_path):
    src = sample(*ZERO2) / OPTIM0
    tree = pr.load(src).obj
    state = tree["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["exp_avg"] = dataclasses.replace(state["exp_avg"], shape=(1,))
    with pytest.raises(pw.UnwritableObject, match=r"\['exp_avg'\].*tensor metadata was edited"):
        pw.dumps(tree)


def test_unknown_objects_are_refused_with_their_path():
    with pytest.raises(pw.UnwritableObject, match=r"\['a'\]\[1\].*builtins.object"):
        pw.dumps({"a": [1, object()]})


def test_tensors_from_another_file_are_refused(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(2)}, a)
    torch.save({"w": torch.ones(2)}, b)
    tree = pr.load(a).obj
    tree["w"] = pr.load(b).obj["w"]
    with pytest.raises(UnsupportedCheckpoint, match="not from this file"):
        pw.rewrite_torch_zip(a, tmp_path / "out.pt", tree)


def test_forced_zip64_records_are_read_by_zipfile_and_torch(tmp_path, monkeypatch):
    """With the ZIP64 threshold lowered, every member takes the >4 GiB path (ZIP64 extra fields in local
    and central headers, 8-byte data descriptors); Python's zipfile (CRCs) and torch must still read it."""
    monkeypatch.setattr(pw, "_ZIP64_LIMIT", 64)
    src = sample("torch", "plain.pt")
    tree = pr.load(src).obj
    out = tmp_path / "zip64.pt"
    pw.rewrite_torch_zip(src, out, tree)
    with zipfile.ZipFile(out) as zf:
        assert all(i.extra[:2] == b"\x01\x00" for i in zf.infolist() if i.file_size >= 64)
    assert members(out) == members(src)
    assert_same_tree(torch.load(src, weights_only=False), torch.load(out, weights_only=False))
    assert pr.load(out).obj.keys() == tree.keys()


def test_zip64_local_header_at_large_offsets():
    """Torch's padding rule with both ZIP64 fields present: data lands on a 64-byte boundary."""
    name, offset, size = b"archive/data/0", (5 << 30) + 7, 6 << 30
    header = pw._local_header(name, offset, size, 64)
    (sig, _, flags, *_rest, name_len, extra_len) = struct.unpack("<IHHHHHIIIHH", header[:30])
    extra = header[30 + name_len :]
    assert sig == 0x04034B50 and flags == 0x0808 and len(extra) == extra_len
    assert struct.unpack("<HHQQQ", extra[:28]) == (1, 24, size, 0, offset)  # as miniz writes it
    assert extra[28:30] == b"FB" and (offset + len(header)) % 64 == 0
    assert pw._data_descriptor(0, size, offset) == struct.pack("<IIQQ", 0x08074B50, 0, size, size)
    central = pw._central_entry(name, offset, size, 0)
    assert struct.unpack("<II", central[20:28]) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert struct.unpack("<I", central[42:46])[0] == 0xFFFFFFFF
    assert central[46 + len(name) :] == struct.pack("<HHQQQ", 1, 24, size, size, offset)


def test_pickle_never_imports_what_it_names(tmp_path):
    """dumps writes GLOBAL opcodes from recorded names; a module that does not exist stays unimported."""
    cls = pr.opaque_class("no_such_module_xyz.Thing")
    cls.pickle_global = ("no_such_module_xyz", "Thing")
    thing = cls.__new__(cls)
    thing.__setstate__({"a": 1})
    data = pw.dumps({"t": thing})
    assert "no_such_module_xyz" not in sys.modules
    assert b"cno_such_module_xyz\nThing\n" in data
    loaded = pr._unpickle(data, None, None, "mem")[0]["t"]
    assert loaded.cls == "no_such_module_xyz.Thing" and loaded.made_by == "newobj" and loaded.state == {"a": 1}
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(data)
