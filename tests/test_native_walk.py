"""The pickle safety walk in C (`read.native_walk`, compiled on first use) against the Python walk it mirrors
(`pickle_reader._walk_expansion`): on every sample pickle, the hash bombs and nesting bombs, and seeded mutations
and random opcode streams, the C walk either passes a pickle with the very length the Python walk gives, or hands
it to the Python walk (never passes what Python refuses). Skipped where no C compiler is found."""

from __future__ import annotations

import pickle
import random
import struct
import zipfile

import pytest

from conftest import SAMPLES
from test_hostile_pickles import HASH_BOMBS
from ckpt_tools.read import native_walk, pickle_reader as P


@pytest.fixture(scope="module")
def c_walk():
    walk = P._native_walk()
    if walk is None:
        pytest.skip("no C walk here (no C compiler, CKPT_NATIVE=0, or the mirror is stale: see the next test)")
    return walk


def test_the_c_walk_mirrors_the_python_walk_as_it_is():
    """The C copy is used only while the Python walk is the one it was written from: after an edit of
    `_walk_expansion`, `_refill`, `_op_table` or the constants, bring native_walk.SOURCE in line and set
    native_walk.MIRRORS to the new fingerprint."""
    assert P.walk_fingerprint() == native_walk.MIRRORS, (
        f"pickle_reader's walk changed: update native_walk.SOURCE to match it, then MIRRORS = {P.walk_fingerprint()!r}"
    )


def test_a_stale_mirror_or_ckpt_native_0_falls_back_to_python(monkeypatch):
    monkeypatch.setattr(P, "_native", [])
    monkeypatch.setattr(native_walk, "MIRRORS", "0" * 16)
    assert P._native_walk() is None
    monkeypatch.setattr(P, "_native", [])
    monkeypatch.setenv("CKPT_NATIVE", "0")
    assert P._native_walk() is None
    # and the Python walk still decides: a hash bomb is refused
    with pytest.raises(P.CorruptCheckpoint, match="hash bomb"):
        P.check_expansion(b"\x80\x02" + HASH_BOMBS["dict_key_memo"] + b".", "bomb.pkl")


def _python(data: bytes):
    try:
        return P._walk_expansion(data, "x")
    except Exception as e:  # noqa: BLE001  the refusal is what is compared
        return type(e).__name__


def _agree(walk, data: bytes) -> str | None:
    """None when the C walk agrees with Python on `data`, else what differs."""
    c, py = walk(data), _python(data)
    if c >= 0 and c != py:
        return f"C passes (length {c}), Python says {py}: {data[:80]!r}"
    return None


def _sample_pickles() -> list[bytes]:
    out = []
    for f in sorted(SAMPLES.rglob("*")):
        if not f.is_file() or f.stat().st_size > 8 << 20:
            continue
        raw = f.read_bytes()
        if raw[:4] == b"PK\x03\x04" and zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                out += [z.read(n) for n in z.namelist() if n.endswith("data.pkl")]
        elif raw[:1] == b"\x80":
            out.append(raw)
    return out


def _put(k: int) -> bytes:
    return b"r" + struct.pack("<I", k)


def _get(k: int) -> bytes:
    return b"j" + struct.pack("<I", k)


def _chain_at(key: int, depth: int, base: int = 200_000) -> bytes:
    """memo[key] = a tuple of 2**depth items built from shared halves, memoized far from the pickle's own keys."""
    b = b")" + _put(base) + b"0"
    for i in range(1, depth + 1):
        b += _get(base + i - 1) + _get(base + i - 1) + b"\x86" + _put(base + i) + b"0"
    return b + _get(base + depth) + _put(key) + b"0"


def _hostile() -> list[bytes]:
    out = [b"\x80\x02" + bomb + b"." for bomb in HASH_BOMBS.values()]
    out += [
        b"\x80\x02" + b"(" * 300 + b"K\x01" + b"t" * 300 + b".",  # 300 nested tuples
        b"\x80\x02]" + b"(]" * 300 + b"e" * 300 + b".",  # 300 nested lists
        b"\x80\x02]" + b"]q\x00" + b"h\x00a" * 300 + b".",
    ]  # one list appended to itself
    # a memo key first held far out (the C walk's hash table), then inside its dense array as it grows: the
    # entry must move with it, or a bomb through that key would pass in C
    laughs = b"\x80\x02]" + _chain_at(100_000, 18)
    for i in range(40_000):
        laughs += b"K\x01" + _put(i) + b"0"
    out += [laughs + b"(" + _get(100_000) * n + b"la." for n in (5, 40)]
    out += [pickle.dumps({"a": [1, 2, (3, 4)], "b": frozenset([1, 2])}, protocol=p) for p in range(6)]
    return out


def test_samples_and_bombs_agree(c_walk):
    cases = _sample_pickles() + _hostile()
    assert len(cases) > 300
    bad = [d for d in (_agree(c_walk, c) for c in cases) if d]
    assert not bad, "\n".join(bad[:5])
    # the bombs are refused by both (C hands them over; Python names them)
    for data in _hostile()[: len(HASH_BOMBS)]:
        assert c_walk(data) == -1 and _python(data) == "CorruptCheckpoint"


def test_mutated_samples_agree(c_walk):
    rng = random.Random(40)
    cases = _sample_pickles()[:120] + _hostile()
    bad = []
    for data in cases:
        data = data[:20_000]
        for _ in range(25):
            m = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                m[rng.randrange(len(m))] = rng.randrange(256)
            bad += [d for d in (_agree(c_walk, bytes(m)), _agree(c_walk, data[: rng.randrange(len(data) + 1)])) if d]
    assert not bad, "\n".join(bad[:5])


_OPS = [
    b"(",
    b")",
    b"]",
    b"}",
    b"\x8f",
    b"N",
    b"\x88",
    b"\x89",
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
    b"\x90",
    b"\x91",
    b"b",
    b"R",
    b"\x81",
    b"\x92",
    b"Q",
    b"0",
    b"1",
    b"2",
    b"\x94",
    b"\x93",
    b"o",
    b"\x8c\x01a",
    b"X\x02\x00\x00\x00ab",
    b"cmod\nname\n",
    b"imod\nname\n",
    b"I12\n",
    b"C\x01x",
    b"\x95" + bytes(8),
]


def test_random_opcode_streams_agree(c_walk):
    """Streams no pickler writes (short stacks, stray MARKs, memo keys out of order): where the two walks could
    part."""
    rng = random.Random(41)
    keys = [0, 1, 2, 5, 255, 256, 70_000]
    bad, passed = [], 0
    for _ in range(6000):
        parts = [b"\x80\x04"]
        for _ in range(rng.choice([3, 10, 40, 150])):
            r = rng.random()
            if r < 0.02:
                parts.append(rng.choice([b"\x85", b"(", b"]", b")"]) * rng.randrange(50, 300))
            elif r < 0.25:
                k = rng.choice(keys)
                parts.append(
                    rng.choice(
                        [b"q" + bytes([k & 255]), _put(k), b"h" + bytes([k & 255]), _get(k), b"p%d\n" % k, b"g%d\n" % k]
                    )
                )
            elif r < 0.3:
                parts.append(b"K" + bytes([rng.randrange(256)]))
            else:
                parts.append(rng.choice(_OPS))
        data = b"".join(parts) + b"."
        d = _agree(c_walk, data)
        if d:
            bad.append(d)
        passed += c_walk(data) >= 0
    assert not bad, "\n".join(bad[:5])
    assert passed > 3000  # most streams pass: the comparison is not only of refusals


def test_a_stream_over_64_mb_is_delimited_by_the_c_walk_not_by_genops(c_walk, tmp_path, monkeypatch):
    """A pickle at the head of a stream over 64 MB (a 700k-item DCP `.metadata` is ~150 MB; a legacy torch file has
    its tensor bytes after its pickles) is delimited by the C walk over a prefix of the stream, not by
    pickletools.genops (pure Python, ~10 us per opcode: minutes at that size); what it reads is the same."""
    import pickletools

    obj = {f"k{i}": (i, "x" * 40) for i in range(50_000)}
    data = pickle.dumps(obj, protocol=4)
    f = tmp_path / "long.pkl"
    with open(f, "wb") as fh:
        fh.write(data)
        fh.truncate(len(data) + (65 << 20))  # sparse: the stream is long, the pickle small
    monkeypatch.setattr(pickletools, "genops", lambda *a: pytest.fail("pickletools.genops delimited the stream"))
    with open(f, "rb") as fh:
        assert P.check_expansion(fh, str(f)) == len(data)
        assert fh.tell() == 0
    assert P.load(f).obj == obj
