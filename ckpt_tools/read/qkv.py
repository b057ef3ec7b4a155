"""A fused attention projection whose weights are saved split: torchtitan's `FusedQKVLinear` (torchtitan 0.3.0,
llama3's default `fuse_qkv=True`).

The module trains one parameter, `<m>.wqkv.weight` (and `.bias`), whose rows are grouped per KV head: for each of
the `n_kv_heads` groups, its `heads_per_kv` query heads, then its key head, then its value head, `head_dim` rows
each. A state-dict hook saves the weight as the stock `<m>.wq.weight`, `<m>.wk.weight`, `<m>.wv.weight` (and merges
them back on load), while the optimizer state stays under the fused name, in the fused row order. The checkpoint
records `wq`'s and `wk`'s row counts (n_heads x head_dim, n_kv_heads x head_dim) but not `n_kv_heads`, which the
row order needs: the user gives it (`--n-kv-heads`).

`find_fused` finds such parameters in a checkpoint's tree (generic: an optimizer state under a name the model does
not hold, beside model keys of the same module and leaf whose elements add up to it); `row_index` says which fused
rows each split tensor is, and `assemble` / `fuse` put split tensors back at their rows, as torchtitan's own save /
load hooks move the weight.
"""

from __future__ import annotations

from typing import Any

from ..errors import CkptError
from .tree import GroupNode, TensorNode, iter_tensors

#: the split parameters' module names, in the fused row order within a group, and the fused module's name
SPLIT = ("wq", "wk", "wv")
FUSED = "wqkv"


def fused_name(split_name: str) -> str | None:
    """`<m>.wq.weight` -> `<m>.wqkv.weight` (None for any other name)."""
    parts = split_name.rsplit(".", 2)
    if len(parts) == 3 and parts[1] == SPLIT[0]:
        return f"{parts[0]}.{FUSED}.{parts[2]}"
    return None


def split_names(fused: str) -> tuple[str, str, str]:
    """`<m>.wqkv.weight` -> (`<m>.wq.weight`, `<m>.wk.weight`, `<m>.wv.weight`)."""
    head, mod, leaf = fused.rsplit(".", 2)
    if mod != FUSED:
        raise ValueError(f"{fused} is not a fused {FUSED} parameter")
    return tuple(f"{head}.{s}.{leaf}" for s in SPLIT)  # type: ignore[return-value]


def row_index(q_rows: int, kv_rows: int, n_kv_heads: int) -> tuple[list[int], list[int], list[int]]:
    """The fused rows that hold `wq`'s, `wk`'s and `wv`'s rows, in their order. ValueError where the row counts
    do not divide by `n_kv_heads` (the wrong value for this model)."""
    if n_kv_heads < 1 or kv_rows % n_kv_heads or q_rows % kv_rows:
        raise ValueError(
            f"wq has {q_rows} rows and wk {kv_rows}: not a model with {n_kv_heads} KV heads "
            f"(wk's rows must be n_kv_heads x head_dim, wq's a multiple of them)"
        )
    hd, hpk = kv_rows // n_kv_heads, q_rows // kv_rows
    width = (hpk + 2) * hd  # one KV group's rows in the fused weight
    q = [g * width + j * hd + d for g in range(n_kv_heads) for j in range(hpk) for d in range(hd)]
    k = [g * width + hpk * hd + d for g in range(n_kv_heads) for d in range(hd)]
    v = [g * width + (hpk + 1) * hd + d for g in range(n_kv_heads) for d in range(hd)]
    return q, k, v


def rows_or_refuse(q_rows: int, kv_rows: int, n_kv_heads: int, path: Any) -> tuple[list[int], list[int], list[int]]:
    """`row_index`, or the one-line CkptError for an `--n-kv-heads` the saved shapes rule out."""
    try:
        return row_index(q_rows, kv_rows, n_kv_heads)
    except ValueError as e:
        raise CkptError(
            f"--n-kv-heads {n_kv_heads}: {e}",
            path=path,
            hint="give the model's number of KV heads (n_kv_heads in its model args)",
        ) from None


def assemble(pieces: list[tuple[Any, Any]]) -> Any:
    """The fused tensor from (rows, split tensor) pairs (torch tensors, rows first; the rows cover it once)."""
    import torch  # lazy: torch only when tensors are assembled; read/ is the torch-free core

    first = pieces[0][1]
    out = torch.empty((sum(len(rows) for rows, _ in pieces), *first.shape[1:]), dtype=first.dtype)
    for rows, t in pieces:
        out[torch.tensor(list(rows))] = t
    return out


def fuse(q: Any, k: Any, v: Any, n_kv_heads: int) -> Any:
    """The fused tensor from the three split ones, rows ordered for `n_kv_heads` KV heads."""
    return assemble(list(zip(row_index(q.shape[0], k.shape[0], n_kv_heads), (q, k, v))))


def rope_halves(w: Any, n_heads: int) -> Any:
    """Each of `n_heads` heads' rows from interleaved RoPE pairs (x0, y0, x1, y1, ...: torchtitan's complex RoPE)
    to rotate-half order (x0, x1, ..., y0, y1, ...: Megatron-core's and Hugging Face's rotary embedding), as
    torchtitan's own Hugging Face converter permutes q and k."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


#: the merge rule of a Megatron-core `linear_qkv` made from a torchtitan attention (`megatron_qkv`)
MEGATRON_RULE = "megatron_qkv"


def megatron_rule(n_heads: int, n_kv_heads: int) -> str:
    return f"{MEGATRON_RULE}:{n_heads}:{n_kv_heads}"


def megatron_qkv(rule: str, parts: list[Any]) -> Any:
    """Megatron-core's `linear_qkv` rows (per query group: its query heads, its key head, its value head; q and k
    in rotate-half order) from torchtitan's split `wq`, `wk`, `wv` (three parts) or its fused `wqkv` (one part,
    already grouped so: an optimizer state), q and k rows in torchtitan's interleaved RoPE order."""
    _, heads, groups = rule.split(":")
    heads, groups = int(heads), int(groups)
    if len(parts) == 1:
        whole = parts[0]
        hd = whole.shape[0] // (heads + 2 * groups)
        q, k, v = (whole[idx] for idx in row_index(heads * hd, groups * hd, groups))
    else:
        q, k, v = parts
    return fuse(rope_halves(q, heads), rope_halves(k, groups), v, groups)


def find_fused(tree: Any) -> dict[str, list[str]]:
    """{optimizer FQN: [the model keys that hold it]} for every parameter saved split: an optimizer state (of the
    first optimizer) under a name the model does not hold, whose module has model keys with the same leaf name,
    without optimizer state of their own, whose elements add up to the state's."""
    kids = tree.children if isinstance(tree, GroupNode) else {}
    model = kids.get("model")
    state = next(
        (o.children.get("state") for k, o in kids.items() if k.startswith("optimizer") and isinstance(o, GroupNode)),
        None,
    )
    if not isinstance(model, GroupNode) or not isinstance(state, GroupNode):
        return {}
    names = {k: t for k, t in iter_tensors(model)}
    out: dict[str, list[str]] = {}
    for fqn, entry in state.children.items():
        if fqn in names or not isinstance(entry, GroupNode) or "." not in fqn:
            continue
        ref = next((t for t in entry.children.values() if isinstance(t, TensorNode) and t.numel > 1), None)
        parent, leaf = fqn.rsplit(".", 1)
        parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        parts = [
            k for k in names if k.endswith("." + leaf) and k.rsplit(".", 2)[0] == parent and k not in state.children
        ]
        if ref is not None and len(parts) > 1 and sum(names[k].numel for k in parts) == ref.numel:
            out[fqn] = parts
    return out


def ordered_parts(fused: str, parts: list[str]) -> tuple[str, str, str]:
    """The split keys of `fused` in (wq, wk, wv) order; ValueError for a fused parameter of another layout."""
    try:
        want = split_names(fused)
    except ValueError:
        want = None
    if want is None or sorted(want) != sorted(parts):
        raise ValueError(
            f"{fused} is saved as {', '.join(parts)}: only torchtitan's FusedQKVLinear layout "
            f"({FUSED} saved as {'/'.join(SPLIT)}) is known"
        )
    return want
