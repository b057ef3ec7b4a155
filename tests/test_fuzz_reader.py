"""Property tests of the safe reader: random pickle opcode streams and random mutations of real sample
files either parse or raise CkptError, never another exception, never hang, never execute anything.

Fixed budget, derandomized: the same examples every CI run, well under a minute.
"""

from __future__ import annotations

import io as _io
import struct
import tempfile
import zipfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SAMPLES
from hostile import pickles as H

from ckpt_tools.read import pickle_reader
from ckpt_tools.errors import CkptError
from ckpt_tools.read.tree import to_node

_TMP = Path(tempfile.mkdtemp(prefix="ckpt-fuzz-"))
MARKER = _TMP / "EXECUTED"
_CMD = f"touch {MARKER}"

FUZZ = settings(
    max_examples=250,
    derandomize=True,
    deadline=3000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_NOARG = [
    b"(",
    b"0",
    b"1",
    b"2",
    b"N",
    b"\x88",
    b"\x89",
    b"}",
    b"]",
    b")",
    b"t",
    b"\x85",
    b"\x86",
    b"\x87",
    b"l",
    b"d",
    b"a",
    b"e",
    b"s",
    b"u",
    b"R",
    b"b",
    b"\x81",
    b"\x8f",
    b"\x90",
    b"\x91",
    b"\x93",
    b"\x94",
    b"o",
    b"Q",
    b"\x92",
]
_GLOBALS = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("subprocess", "Popen"),
    ("builtins", "bytes"),
    ("builtins", "bytearray"),
    ("builtins", "str"),
    ("builtins", "set"),
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "FloatStorage"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("copyreg", "_reconstructor"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "dtype"),
    ("argparse", "Namespace"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("_codecs", "encode"),
    ("torch", "bfloat16"),
]
_TEXTS = [
    "storage",
    "0",
    "cpu",
    _CMD,
    "os",
    "system",
    "__class__",
    "__base__",
    "__subclasses__",
    "__setstate__",
    "latin1",
    "lr",
    "",
    "x" * 300,
]


def _op():
    return st.one_of(
        st.sampled_from(_NOARG),
        st.integers(0, 255).map(lambda n: b"K" + bytes([n])),
        st.integers(-(2**31), 2**31 - 1).map(lambda n: b"J" + struct.pack("<i", n)),
        st.integers(-(2**70), 2**70).map(lambda n: b"\x8a" + bytes([len(_le(n))]) + _le(n)),
        st.floats(allow_nan=True).map(lambda f: b"G" + struct.pack(">d", f)),
        st.sampled_from(_TEXTS).map(H.text),
        st.binary(max_size=40).map(lambda b: b"C" + bytes([len(b)]) + b),
        st.integers(0, 40).map(lambda n: b"q" + bytes([n])),
        st.integers(0, 40).map(lambda n: b"h" + bytes([n])),
        st.integers(0, 2**32 - 1).map(lambda n: b"j" + struct.pack("<I", n)),
        st.sampled_from(_GLOBALS).map(lambda g: H.glob(*g)),
        st.sampled_from(_GLOBALS).map(lambda g: b"i" + g[0].encode() + b"\n" + g[1].encode() + b"\n"),
        st.integers(0, 255).map(lambda n: b"\x82" + bytes([n])),  # EXT1
        st.just(
            b"(" + H.text("storage") + H.glob("torch", "FloatStorage") + H.text("0") + H.text("cpu") + b"K\x04t" + b"Q"
        ),  # a persistent id for storage "0"
        st.binary(min_size=1, max_size=8),  # raw noise
    )


def _le(n: int) -> bytes:
    length = max(1, (n.bit_length() + 8) // 8)
    return n.to_bytes(length, "little", signed=True)


def _torch_zip(pkl: bytes) -> bytes:
    buf = _io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", struct.pack("<4f", 1, 2, 3, 4))
    return buf.getvalue()


def _check(data: bytes, name: str) -> None:
    f = _TMP / name
    f.write_bytes(data)
    try:
        loaded = pickle_reader.load(f)
        to_node(loaded.obj, name)
        if loaded.source is not None:
            loaded.source.close()
    except CkptError:
        pass
    assert not MARKER.exists(), "the reader EXECUTED a payload"


@FUZZ
@given(ops=st.lists(_op(), max_size=60), proto=st.sampled_from([2, 4]), as_zip=st.booleans())
def test_random_opcode_streams(ops, proto, as_zip):
    pkl = bytes([0x80, proto]) + b"".join(ops) + b"."
    _check(_torch_zip(pkl) if as_zip else pkl, "ops.bin")


def _small_samples() -> list[bytes]:
    files = [
        SAMPLES / "torch" / "plain.pt",
        SAMPLES / "accelerate" / "accelerate_ddp" / "scheduler.bin",
        SAMPLES / "accelerate" / "accelerate_ddp" / "random_states_0.pkl",
        SAMPLES / "deepspeed" / "zero2_bf16" / "global_step4" / "mp_rank_00_model_states.pt",
        SAMPLES / "fsdp" / "fsdp2_dcp" / ".metadata",
        SAMPLES / "fsdp" / "fsdp1_sharded" / "rank0.pt",
    ]
    return [f.read_bytes() for f in files]


_SAMPLE_BYTES = _small_samples()


@st.composite
def _mutated(draw):
    data = bytearray(draw(st.sampled_from(_SAMPLE_BYTES)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite", "pickle_region"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[pos : pos + len(chunk)] = chunk
        else:  # aim at the pickle: the first 6 KiB hold data.pkl in these small files
            p = draw(st.integers(0, min(len(data), 6000) - 1))
            data[p] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(data=_mutated())
def test_random_mutations_of_real_files(data):
    _check(data, "mutated.pt")


@settings(max_examples=60, derandomize=True, deadline=3000, database=None)
@given(cut=st.integers(0, 10**6), flip=st.integers(0, 10**6))
def test_mutated_files_read_tensor_bytes_safely(cut, flip):
    """Reading values after a mutation: CkptError (or a value), never an IndexError / struct.error."""
    data = bytearray(_SAMPLE_BYTES[0])
    data[flip % len(data)] ^= 0x5A
    f = _TMP / "values.pt"
    f.write_bytes(bytes(data[: max(1, len(data) - cut % 4096)]))
    try:
        loaded = pickle_reader.load(f)
    except CkptError:
        return
    from ckpt_tools.read.pickle_reader import TensorRef

    def tensors(o):
        if isinstance(o, TensorRef):
            yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from tensors(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                yield from tensors(v)

    for t in list(tensors(loaded.obj))[:5]:
        try:
            t.read_values() if t.numel <= 64 else t.read_numpy()
        except CkptError:
            pass
        except ValueError as e:  # documented: non-contiguous / no scalar decoding for this dtype
            assert "contiguous" in str(e) or "decoding" in str(e) or "storage" in str(e), e
    loaded.source.close()


def test_zip_version_field_found_by_fuzzing():
    """Found by the fuzzer: one byte of a central-directory entry's "version needed" field (0x2d -> 0x40)
    made zipfile raise NotImplementedError, which escaped as a traceback."""
    raw = bytearray(_SAMPLE_BYTES[1])
    cd = raw.rindex(b"PK\x01\x02")
    raw[cd + 6] = 0x40  # version needed to extract: 6.4
    f = _TMP / "zipver.bin"
    f.write_bytes(bytes(raw))
    try:
        pickle_reader.load(f)
    except CkptError as e:
        assert "zip" in e.message
