"""The small reads a reader plans up front (`remote.plan(..., exact=True)`: a DCP folder's small items) over a store:
close ranges are one GET, far ones are not merged across the bytes between them unless that stays within a small
multiple of the bytes needed, and `stats()` says what they cost."""

from __future__ import annotations

import os

from ckpt_tools.read import remote


def _mounted(tmp_path, size: int):
    src = tmp_path / "store"
    src.mkdir()
    data = bytes(range(256)) * (size // 256)
    (src / "obj.bin").write_bytes(data)
    m = remote.mount(f"file://{src}", prime=False)
    return m, os.path.join(m.root, "obj.bin"), data


def test_close_ranges_are_one_request_and_far_ones_are_not_merged_across_tensor_bytes(tmp_path):
    m, local, data = _mounted(tmp_path, 8 << 20)
    try:
        close = [(local, i * 1024, 100) for i in range(20)]  # 20 items 1 KiB apart: one GET
        far = [(local, (1 << 20) + i * (100 << 10), 100) for i in range(40)]  # 40 items 100 KiB apart
        m.ensure_small(close + far)
        c = m.counters
        # 41 runs: more than SMALL_GETS, but merging a 100 KiB gap would pass SMALL_BYTES_FACTOR x the 6,000 bytes
        # needed: each far item is its own GET, and only the close items' gaps are fetched beyond what is needed
        assert c.get_requests == 41
        assert c.bytes_fetched == 19 * 1024 + 100 + 40 * 100
        assert remote.stats()["small_reads"] == {
            "ranges": 60,
            "bytes_needed": 6000,
            "get_requests": 41,
            "bytes_fetched": c.bytes_fetched,
        }
        with open(local, "rb") as fh:
            for _, start, n in close + far:
                fh.seek(start)
                assert fh.read(n) == data[start : start + n]
        m.ensure_small(close)  # held already: nothing more
        assert m.counters.get_requests == 41
    finally:
        m.close()


def test_many_ranges_a_short_way_apart_are_merged_closest_first_within_the_byte_budget(tmp_path):
    m, local, data = _mounted(tmp_path, 16 << 20)
    try:
        # 100 items of 64 KiB, 80 KiB apart (gaps over ALIGN): merged down to SMALL_GETS requests, which stays
        # within SMALL_BYTES_FACTOR x the 6.4 MB needed
        wants = [(local, i * (144 << 10), 64 << 10) for i in range(100)]
        m.ensure_small(wants)
        c = m.counters
        assert c.get_requests == remote.SMALL_GETS
        assert c.bytes_fetched == 100 * (64 << 10) + (100 - remote.SMALL_GETS) * (80 << 10)
        assert c.bytes_fetched <= remote.SMALL_BYTES_FACTOR * 100 * (64 << 10) + remote.ALIGN
    finally:
        m.close()


def test_optional_ranges_cost_a_fixed_budget_however_many_and_far_apart(tmp_path):
    m, local, data = _mounted(tmp_path, 48 << 20)
    try:
        needed = [(local, i * (1 << 20), 100) for i in range(5)]  # always fetched, one GET each
        # 200 optional items 150 KiB apart (one Adam `step` per parameter between the tensors' bytes), then a dense
        # run of 40 a KiB apart: the dense run first (most items per byte), then single far items while GETs remain
        far = [(local, (6 << 20) + i * (150 << 10), 100) for i in range(200)]
        dense = [(local, (5 << 20) + (512 << 10) + i * 1024, 100) for i in range(40)]
        m.ensure_small(needed, far + dense)
        c = m.counters
        assert c.get_requests == remote.SMALL_GETS
        assert all(remote.held(p, s, n) for p, s, n in needed + dense)
        got = [w for w in far if remote.held(*w)]
        assert len(got) == remote.SMALL_GETS - 5 - 1
        assert c.planned_not_read == 200 - len(got)
        assert remote.stats()["small_reads"]["not_read"] == c.planned_not_read
        assert c.bytes_fetched < 100 * 1024
        with open(local, "rb") as fh:
            for _, start, n in needed + dense + got:
                fh.seek(start)
                assert fh.read(n) == data[start : start + n]
        # a dense run longer than the byte budget is cut at the end of the last item that fits
        m2_items = [(local, (36 << 20) + i * 4096, 4000) for i in range(3000)]  # 12 MB of items, 4 KiB apart
        old = remote.OPTIONAL_BYTES
        remote.OPTIONAL_BYTES = 1 << 20
        try:
            before = c.bytes_fetched
            m.ensure_small([], m2_items)
        finally:
            remote.OPTIONAL_BYTES = old
        assert 1 << 19 < c.bytes_fetched - before <= 1 << 20
        held = [remote.held(*w) for w in m2_items]
        assert held[0] and not held[-1] and held == sorted(held, reverse=True)
    finally:
        m.close()
