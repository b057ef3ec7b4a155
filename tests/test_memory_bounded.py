"""Chunked reading (`ckpt inspect --stats`, `ckpt diff`): the numbers are those of a whole-tensor computation
with torch, with the chunk size forced down to a few elements so that every tensor crosses chunk
boundaries (and ZeRO pieces, TP shards and chunks cut each other at odd places).

How much memory the commands take on a big checkpoint is measured by `bench/bench_memory.py`, not here."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from conftest import sample
from ckpt_tools.view import logical
from ckpt_tools import open_checkpoint
from ckpt_tools.ops import diff as diff_ops
from ckpt_tools.ops import inspect as inspect_ops
from ckpt_tools.read.tree import iter_tensors

SMALL_CHUNK = 5  # elements: smaller than every ZeRO piece and not a divisor of any tensor size


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(diff_ops, "CHUNK_ELEMS", SMALL_CHUNK)


def _expected_stats(x: torch.Tensor) -> dict:
    """What `tensor_stats` computes, straight from the whole tensor (values as float32, as it documents)."""
    x = x.reshape(-1)
    x = x.float() if x.is_floating_point() else (x.abs().float() if x.is_complex() else x.double().float())
    fin = x[torch.isfinite(x)]
    out = {"nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}
    if fin.numel():
        out.update(
            min=float(fin.min()),
            max=float(fin.max()),
            mean=float(fin.double().mean()),
            std=float(fin.double().std()) if fin.numel() > 1 else 0.0,
        )
    else:
        out.update(min=None, max=None, mean=None, std=None)
    return out


def _assert_stats_match(ck, rows) -> int:
    by_path = dict(iter_tensors(ck.tree))
    crossed = 0
    for s in rows:
        want = _expected_stats(by_path[s.path].read_torch())
        assert (s.nan, s.inf, s.min, s.max) == (want["nan"], want["inf"], want["min"], want["max"]), s.path
        if want["mean"] is None:
            assert s.mean is None and s.std is None
            continue
        # float64 sums in another order: equal to a few units in the last place of the spread
        scale = max(abs(want["mean"]), want["std"], 1e-300)
        assert abs(s.mean - want["mean"]) <= 1e-12 * scale, (s.path, s.mean, want["mean"])
        assert abs(s.std - want["std"]) <= 1e-12 * scale, (s.path, s.std, want["std"])
        crossed += math.prod(s.shape) > SMALL_CHUNK
    return crossed


def test_chunked_stats_equal_whole_tensor_stats_on_zero2(small_chunks):
    ck = open_checkpoint(sample("deepspeed", "zero2_bf16"))
    rows = list(inspect_ops.tensor_stats(ck))
    assert len(rows) == sum(1 for _, t in iter_tensors(ck.tree) if t.numel)
    # the fp32 masters and Adam moments are split across the two DP ranks' flat partitions
    split = [s.path for s in rows if len(ck.get(s.path).pieces) > 1]
    assert split, "no tensor of the sample spans two ZeRO partitions"
    assert _assert_stats_match(ck, rows) > 50


def test_chunked_stats_on_tp_shards(small_chunks):
    ck = open_checkpoint(sample("megatron", "gpt_tp2_pp2"))
    rows = list(inspect_ops.tensor_stats(ck))
    merged = [s for s in rows if ck.get(s.path).shards]
    assert merged, "the sample has no TP-sharded tensor"
    assert _assert_stats_match(ck, rows) > 50


def test_chunked_stats_count_nan_and_inf_across_chunks(small_chunks, tmp_path):
    x = torch.linspace(-3, 5, 23, dtype=torch.float32)
    x[[1, 4, 5, 11]] = float("nan")  # in the first, second and third chunk of 5
    x[[9, 22]] = float("inf")
    x[10] = -float("inf")
    torch.save(
        {
            "w": x,
            "h": x.bfloat16(),
            "i": torch.arange(-7, 13, dtype=torch.int64),
            "all_nan": torch.full((7,), float("nan")),
        },
        tmp_path / "x.pt",
    )
    ck = open_checkpoint(tmp_path / "x.pt")
    rows = {s.path.rsplit(".", 1)[-1]: s for s in inspect_ops.tensor_stats(ck)}
    assert (rows["w"].nan, rows["w"].inf) == (4, 3) and (rows["h"].nan, rows["h"].inf) == (4, 3)
    assert rows["all_nan"].nan == 7 and rows["all_nan"].mean is None
    assert rows["i"].min == -7.0 and rows["i"].max == 12.0
    _assert_stats_match(ck, list(rows.values()))
    warned = [w.path for w in inspect_ops.stats_warnings(list(rows.values()))]
    assert warned == [rows[k].path for k in ("w", "h", "all_nan")]


def _torch_compare(a: torch.Tensor, b: torch.Tensor, atol: float) -> tuple[bool, bool, float]:
    """(bit-identical, within atol, max |a - b|) from the whole tensors."""
    fa, fb = a.double().reshape(-1), b.double().reshape(-1)
    same = a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    both_nan = torch.isnan(fa) & torch.isnan(fb)
    delta = (fa - fb).abs()
    delta[both_nan] = 0
    worst = float(delta.max()) if delta.numel() else 0.0
    close = bool(torch.all((delta <= atol) | both_nan))
    return same, close, worst


def _logical_pairs(a, b) -> dict:
    """(section, name) -> (A's LogicalTensor, B's) for every model tensor and optimizer state both have."""
    ma = {t.name: t for t in logical.model_tensors(a)}
    mb = {t.name: t for t in logical.model_tensors(b)}
    pairs = {("model", n): (ma[n], mb[n]) for n in ma if n in mb}
    oa, ob = logical.optimizer_states(a), logical.optimizer_states(b)
    for p in oa:
        for k in oa[p]:
            if k not in ("fp32", "step") and k in ob.get(p, {}):
                pairs[("optimizer", f"{p}.{k}")] = (oa[p][k], ob[p][k])
    return pairs


def _assert_logical_diff_matches_torch(a, b, atol: float) -> dict:
    report = diff_ops.diff(a, b, atol, mode="logical")
    got = {(d.file, d.field): d for d in report.differences}
    pairs = _logical_pairs(a, b)
    within = 0
    for key, (ta, tb) in pairs.items():
        same, close, worst = _torch_compare(ta.read(), tb.read(), atol)
        if same or close:
            assert key not in got, key
            within += not same
        else:
            assert got[key].max_abs_diff == worst, key
    assert report.within_tolerance == within
    return pairs


@pytest.mark.parametrize("atol", [0.0, 1e-3])
def test_chunked_logical_diff_equals_whole_tensor_comparison(small_chunks, atol):
    pairs = _assert_logical_diff_matches_torch(
        sample("deepspeed", "zero2_bf16"), sample("deepspeed", "zero3_bf16"), atol
    )
    # ZeRO pieces were cut by the chunks
    assert any(ta.numel > SMALL_CHUNK and len(ta.node.pieces) > 1 for ta, _ in pairs.values())


def test_chunked_logical_diff_of_tp_shards_against_universal(small_chunks, tmp_path):
    """TP shards concatenated along dim 1 (row blocks interleaved per read) against the universal output's
    whole tensors: the two sides' chunks are cut at different places."""
    from ckpt_tools.ops import to_universal

    to_universal.execute(to_universal.plan_to_universal(sample("megatron", "gpt_tp2_pp2"), tmp_path / "u"))
    drifted = sample("megatron", "gpt_tp2_pp2_drifted")
    for atol in (0.0, 1e-3):
        pairs = _assert_logical_diff_matches_torch(drifted, tmp_path / "u", atol)
    assert any(diff_ops._cat_layout(ta) is not None for ta, _ in pairs.values())


def test_chunked_file_diff_finds_the_changed_elements(small_chunks, tmp_path):
    before = sample("deepspeed", "zero2_bf16")
    after = tmp_path / "after"
    shutil.copytree(before, after)
    rel = "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(after / rel, weights_only=False)
    flat = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach()  # edits the saved storage
    old = flat.clone()
    flat[7:9] += 0.25  # across the boundary between the second and third chunk of 5
    flat[-1] = float("nan")
    torch.save(sd, after / rel)
    field = "optimizer_state_dict.single_partition_of_fp32_groups.0"

    report = diff_ops.diff(before, after, mode="files")
    hits = [d for d in report.differences if d.file == rel and d.field == field]
    assert len(hits) == 1 and len(report.differences) == 1
    d = (flat.double() - old.double()).abs()
    assert hits[0].max_abs_diff == float(d[~torch.isnan(d)].max())
    # the NaN on one side only keeps it a difference however large the tolerance
    assert not diff_ops.diff(before, after, atol=1.0, mode="files").same
    flat[-1] = old[-1]
    torch.save(sd, after / rel)
    within = diff_ops.diff(before, after, atol=0.26, mode="files")
    assert within.same and within.within_tolerance == 1
    assert not diff_ops.diff(before, after, atol=0.24, mode="files").same
