"""Write a Megatron-LM legacy run folder (`ckpt convert SRC OUT --to megatron --ckpt-format torch [--tp N] [--pp N]`)
from a torch_dist run (plain Adam, or the distributed optimizer at the saved sizes) or from legacy rank files at
another TP / PP: `iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt` per rank, as Megatron's
`--ckpt-format torch` save writes it (see `megatron_write`'s docstring, which `ops.convert` calls through).
"""

from __future__ import annotations

import collections
import copy
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import CorruptCheckpoint, UnsupportedCheckpoint
from ..formats import dcp as dcp_format
from ..formats.dcp import DcpItems
from ..formats.megatron_dist import _flat, _locate, _sharded_param_groups
from ..formats.megatron_lm import _dir_name, _rule
from ..read import pickle_reader as pr
from ..read.pickle_reader import DType, TensorRef
from ..read.tensor_read import FdCache, read_tensor, source_ranges
from ..read.tp_layout import split_shard
from ..view import logical as L
from ..view.logical import MEGATRON_FUSED_NORMS, name_key
from .megatron_common import _LAYER, LATEST, _args, _check_plain_adam, _common_of_rank_file, rank_files
from .torch_zip import save, tensor_record

# --- torch_dist -> legacy (`--to megatron --ckpt-format torch [--tp N]`) ------------------------------------------


def _check_distopt_dist_source(ck, src: Path, tp: int | None, pp: int | None) -> None:
    """Refuse, in one line, a distributed-optimizer torch_dist run ckpt cannot write as legacy rank files with
    distrib_optim.pt: the saved sizes, no virtual pipeline, dp_reshardable buckets (joined per buffer)."""
    saved, saved_pp = ck.topology.tp or 1, ck.topology.pp or 1
    if ck.format != "megatron_torch_dist" or (tp or saved, pp or saved_pp) != (saved, saved_pp) or ck.topology.vpp:
        raise UnsupportedCheckpoint(
            f"a distributed-optimizer run at TP {saved} x PP {saved_pp} (to TP {tp or saved} "
            f"x PP {pp or saved_pp}): ckpt writes its legacy distrib_optim.pt from a torch_dist "
            "save at the saved TP and PP, without a virtual pipeline (each rank's buffers are "
            "Megatron's own, not re-cut)",
            path=src,
        )

    common = pr.load(_dist_iter(ck) / "common.pt").obj
    kind = (common.get("optimizer") or {}).get("param_state_sharding_type")
    if kind != "dp_reshardable":
        raise UnsupportedCheckpoint(
            f"the distributed optimizer's state is saved {kind!r}: ckpt writes the "
            "dp_reshardable buckets into distrib_optim.pt",
            path=src,
        )
    args = _args(ck)
    if not (args.get("bf16") or args.get("fp16")):
        raise UnsupportedCheckpoint(
            "--ckpt-format torch is proven for bf16/fp16 runs; this run trained in fp32", path=src
        )
    domains = {d for d, *_ in _distopt_buckets(ck)}
    if domains != set(range(saved * saved_pp)):  # one distrib_optim.pt per rank file: none may be left behind
        raise UnsupportedCheckpoint(
            f"the distributed optimizer's buckets name model-parallel domains "
            f"{sorted(domains)}, not the {saved * saved_pp} rank files of TP {saved} x PP "
            f"{saved_pp}: ckpt would leave some behind",
            path=src,
        )


#: Megatron-LM's two checkpoint formats, spelled as its own `--ckpt-format` flag spells them
CKPT_FORMATS = ("torch_dist", "torch")
_EXTRA = re.compile(r"^decoder\.layers\.(.+)\._extra_state/shard_\d+_\d+$")


def _dist_iter(ck) -> Path:
    found = _locate(Path(ck.path))
    if found is None:
        raise UnsupportedCheckpoint("no Megatron-LM torch_dist iteration folder", path=Path(ck.path))
    return found[1]


def _padded_vocab(args: dict[str, Any], tp: int) -> int | None:
    """Megatron's `_vocab_size_with_padding` at TP `tp` (what a run launched there builds its embedding with)."""
    vocab, mult = args.get("vocab_size"), args.get("make_vocab_size_divisible_by")
    if not isinstance(vocab, int) or not isinstance(mult, int) or mult <= 0:
        return None
    step = mult * tp
    return -(-vocab // step) * step


def _check_legacy_source(ck, src: Path, tp: int | None, pp: int | None) -> dict[str, Any]:
    """Refuse, in one line, a source that is not a local-spec Megatron-LM run the legacy writer carries (its
    format, its transformer implementation, its optimizer); returns its args."""
    if ck.format not in ("megatron_torch_dist", "megatron_legacy"):
        raise UnsupportedCheckpoint(
            f"--to megatron --ckpt-format torch needs a Megatron-LM checkpoint (torch_dist, or legacy at another "
            f"TP / PP); this is {ck.format}, which holds no Megatron `args`, OptimizerParamScheduler state or "
            "Megatron-core parameter names",
            path=src,
        )
    args = _args(ck)
    if (args.get("transformer_impl") or "local") != "local":
        raise UnsupportedCheckpoint(
            f"a run built with transformer_impl={args.get('transformer_impl')}: its legacy "
            "rank files use Transformer Engine's module names and extra state, which ckpt "
            "does not write (local-spec runs only)",
            path=src,
        )
    if args.get("use_distributed_optimizer"):
        _check_distopt_dist_source(ck, src, tp, pp)
    else:
        _check_plain_adam(
            ck,
            src,
            "--ckpt-format torch",
            "writes the plain Adam rank files",
            "legacy layout (distrib_optim.pt buckets)",
        )
    return args


def _legacy_sizes(ck, src: Path, tp: int | None, pp: int | None) -> tuple[int, int]:
    """The (TP, PP) sizes to write (the saved ones where not given); refuses sizes under 1, another PP with a
    virtual pipeline, and a legacy source at its own sizes (nothing to convert)."""
    saved = ck.topology.tp or 1
    tp = saved if tp is None else tp
    if tp < 1:
        raise UnsupportedCheckpoint(f"--tp {tp}: a tensor-parallel size is 1 or more", path=src)
    saved_pp, vpp = ck.topology.pp or 1, ck.topology.vpp or 1
    pp = saved_pp if pp is None else pp
    if pp < 1:
        raise UnsupportedCheckpoint(f"--pp {pp}: a pipeline-parallel size is 1 or more", path=src)
    if pp != saved_pp and vpp > 1:
        raise UnsupportedCheckpoint(
            f"--pp {pp}: the run uses a virtual pipeline (VPP {vpp}), whose chunks ckpt does "
            "not re-cut for another PP size",
            path=src,
            hint=f"convert at the saved PP ({saved_pp}), or resume the torch_dist run at "
            "the new PP (Megatron reshards it at load)",
        )
    if ck.format == "megatron_legacy" and (tp, pp) == (saved, saved_pp):
        raise UnsupportedCheckpoint(
            f"the checkpoint is already in Megatron-LM's legacy format (--ckpt-format "
            f"torch) at TP {saved} x PP {saved_pp}: nothing to convert",
            path=src,
            hint="--tp N / --pp N write the rank files of another TP / PP size; "
            "--ckpt-format torch_dist the layout Megatron reshards at load",
        )
    return tp, pp


def _check_stages(args: dict[str, Any], src: Path, pp: int, vpp: int, saved_pp: int) -> None:
    """Refuse layers that do not fall into `pp` x `vpp` equal pipeline stages."""
    layers = int(args.get("num_layers") or 0)
    if (
        not layers
        or layers % (pp * vpp)
        or args.get("decoder_first_pipeline_num_layers")
        or args.get("decoder_last_pipeline_num_layers")
        or args.get("pipeline_model_parallel_layout")
        or args.get("account_for_embedding_in_pipeline_split")
        or args.get("account_for_loss_in_pipeline_split")
    ):
        if layers and layers % (pp * vpp) and pp != saved_pp:
            raise UnsupportedCheckpoint(
                f"--pp {pp} does not divide num_layers={layers}"
                f"{f' x VPP {vpp}' if vpp > 1 else ''}: ckpt cuts the layers into equal "
                "stages",
                path=src,
                hint="choose a PP size that divides the layers",
            )
        raise UnsupportedCheckpoint(
            f"num_layers={layers} over PP {pp} x VPP {vpp}: uneven pipeline stages, which "
            "ckpt does not split into legacy rank files yet",
            path=src,
        )


def _check_tp_split(args: dict[str, Any], src: Path, tp: int, saved: int) -> None:
    """At another TP size: refuse one that does not divide the heads, query groups, FFN and padded vocabulary,
    that would pad the vocabulary otherwise, or that turns sequence parallelism off (TP 1)."""
    heads = int(args.get("num_attention_heads") or 0)
    groups = int(args.get("num_query_groups") or 0) if args.get("group_query_attention") else heads
    sizes = {
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "ffn_hidden_size": int(args.get("ffn_hidden_size") or 0),
        "padded_vocab_size": int(args.get("padded_vocab_size") or 0),
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if not v or v % tp]
    if bad:
        raise UnsupportedCheckpoint(
            f"--tp {tp} does not divide {', '.join(bad)}: Megatron splits each of them over the tensor-parallel ranks",
            path=src,
            hint=f"choose a TP size that divides them; saved at TP {saved}",
        )
    want = _padded_vocab(args, tp)
    if want is not None and want != sizes["padded_vocab_size"]:
        raise UnsupportedCheckpoint(
            f"at --tp {tp} Megatron pads the vocabulary ({args.get('vocab_size')}) to {want} rows "
            f"(make_vocab_size_divisible_by={args.get('make_vocab_size_divisible_by')} x TP), not the saved "
            f"{sizes['padded_vocab_size']}: its embedding would not take the saved rows",
            path=src,
            hint="choose a TP size at which the padded vocabulary stays the same",
        )
    if args.get("sequence_parallel") and tp == 1:
        raise UnsupportedCheckpoint(
            "the run used sequence parallelism, which Megatron turns off at TP 1: "
            "relaunch flags would differ from the saved args",
            path=src,
            hint="convert to a TP size of 2 or more",
        )


def _check_legacy_target(ck, src: Path, tp: int | None, pp: int | None) -> tuple[int, int]:
    """Refuse, in one line, a torch_dist source (or a TP / PP size) the legacy writer cannot turn into rank files
    that Megatron loads at that TP x PP; returns the (TP, PP) sizes to write."""
    args = _check_legacy_source(ck, src, tp, pp)
    tp, pp = _legacy_sizes(ck, src, tp, pp)
    _check_stages(args, src, pp, ck.topology.vpp or 1, ck.topology.pp or 1)
    if tp != (ck.topology.tp or 1):
        _check_tp_split(args, src, tp, ck.topology.tp or 1)
    return tp, pp


def _legacy_plan_lines(ck, tp: int, pp: int) -> tuple[list[str], list[str]]:
    """(notes, not moved) for a conversion of a torch_dist run into legacy rank files at TP `tp` x PP `pp`."""
    args = _args(ck)
    saved, saved_pp, vpp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.vpp
    notes = [
        f"Megatron-LM legacy layout (--ckpt-format torch, plain Adam): iter_N/mp_rank_TT"
        f"{'_PPP' if pp > 1 else ''}/model_optim_rng.pt for TP {tp} x PP {pp}"
        f"{f' (virtual pipeline: model0..model{vpp - 1})' if vpp else ''}, saved at TP {saved} x PP {saved_pp}; "
        f"each stage holds {int(args['num_layers']) // pp} of the {args['num_layers']} layers; each rank "
        "file holds its TP shards of the module's weights (bf16) and of the fp32 master and Adam moments, split "
        "by Megatron's own TP rules (column-parallel and vocabulary-parallel dim 0, SwiGLU fc1 per "
        "sub-parameter, row-parallel dim 1, norms and row-parallel biases replicated), its stage's layers "
        "numbered from 0",
        (
            "optimizer (distributed): the rank file's {optimizer: {param_groups}} (with the step) and "
            "distrib_optim.pt beside it, as Megatron's legacy save writes it: buckets_coalesced, each buffer's "
            "fp32 master / exp_avg / exp_avg_sq (its bucket's unpadded elements) and numel_unpadded; "
            if args.get("use_distributed_optimizer")
            else "optimizer: per rank {state: {id: {step, exp_avg, exp_avg_sq}}, param_groups (as saved, with the ids "
            "of this rank's parameters in model order)}, fp32_from_fp16_params; "
        )
        + "opt_param_scheduler, iteration, checkpoint_version and floating-point-operation count as saved",
        "args: carried as saved with ckpt_format=torch, use_dist_ckpt=False and each file's rank / local_rank"
        + (
            f"; tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
            f"world_size={tp * pp * int(args.get('data_parallel_size') or 1)}"
            if (tp, pp) != (saved, saved_pp)
            else ""
        ),
    ]
    source = _legacy_source(ck)
    if source.has_rng:
        source.check_rng()  # every saved rank's RNG state as Megatron's load reads it, before anything is written
    not_moved = []
    if ck.format == "megatron_legacy":
        notes.append(
            f"read from the legacy rank files at TP {saved} x PP {saved_pp}: each whole tensor merged by "
            "Megatron's TP rules, then split again at the new size (one step, no torch_dist copy)"
        )
    else:
        not_moved.append(
            "content_metadata (common.pt: how Megatron built the sharded state dict): the legacy "
            "format has no such field"
        )
    if not source.has_rng:
        not_moved.append(
            f"RNG: the source saved none ({source.none}): the rank files hold no rng_state; relaunch with --no-load-rng"
        )
    elif (tp, pp) == (saved, saved_pp):
        notes.append(f"RNG: each rank's rng_state as saved ({source.label})")
    else:
        not_moved.append(
            f"RNG at another TP x PP: Megatron's own resharding load ignores the saved RNG state (TP "
            f"{saved} x PP {saved_pp} != {tp} x {pp}); a legacy file has no way to say so, so each rank "
            f"file carries the state of the rank it takes its first shard from (TP rank t <- t x {saved} "
            f"// {tp}; stage p <- the saved stage of its first layer): the Python / NumPy / torch "
            "generators are that rank's, and so are the tensor-parallel CUDA tracker "
            "(model-parallel-rng) and expert-parallel-rng. Relaunch with --no-load-rng for Megatron's "
            "fresh seeding instead"
        )
    if ck.tree.children.get("tied_copies") is not None or (
        pp > 1 and not args.get("untie_embeddings_and_output_weights")
    ):
        notes.append(
            "tied embeddings with PP > 1: the last stage's output_layer.weight (Megatron's copy of the word "
            "embeddings) written from the word embeddings, with their optimizer state"
        )
    return notes, not_moved


class _DistSource:
    """What the legacy writer takes from a torch_dist source besides its logical tensors: common.pt, the keys in
    .metadata order (the module order of a rank file's `model`), each saved rank's RNG state."""

    def __init__(self, ck):
        it = _dist_iter(ck)
        self.common = pr.load(it / "common.pt").obj
        self._items = DcpItems(it)
        self.keys = list(self._items.sdm)
        self.has_rng = any(k.startswith("rng_state/") for k in self.keys)
        self.label, self.none = "rng_state/shard_{pp}.{tp}_PP.TP", "no rng_state items"

    def rng(self, p: int, t: int, pp: int, tp: int):
        key = f"rng_state/shard_{p}.{t}_{pp}.{tp}"
        return self._rng(key) if (key, None) in self._items.items else None

    def _rng(self, key: str):
        """The legacy `rng_state` list of item `key`: Megatron's ShardedObject `rng_state` holds [that list]."""
        it = self._items.item(key)
        where = self._items.root / it.rel
        if it.is_tensor:
            raise _bad_rng(key, "a tensor", where, wrapped=True)
        obj = self._items.value(key)
        if not (isinstance(obj, (list, tuple)) and len(obj) == 1):
            raise _bad_rng(key, _what(obj), where, wrapped=True)
        return _rng_list(obj[0], key, where)

    def check_rng(self) -> None:
        for key in self.keys:
            if key.startswith("rng_state/"):
                self._rng(key)


class _LegacySource:
    """The same, from legacy rank files (legacy -> legacy at another TP / PP): common.pt's fields from rank (0, 0)'s
    file, the keys in the order the rank files' models list their modules (stage after stage, chunk after chunk:
    the order Megatron's sharded state dict, so its .metadata, lists them), each rank file's RNG state."""

    def __init__(self, ck):
        self._files = rank_files(ck)
        first = self._files[min(self._files)]
        obj0 = pr.load(first).obj
        self.common = _common_of_rank_file(first, obj0)
        args = _args(ck)
        layers = int(args.get("num_layers") or 0)
        tied = not args.get("untie_embeddings_and_output_weights")
        keys: list[str] = []
        for (t, p), f in sorted(self._files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if t:
                continue
            o = obj0 if f == first else pr.load(f).obj
            chunks = sorted(
                (k for k in o if isinstance(k, str) and re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0)
            )
            for local in (str(k) for c in chunks for k in o[c]):
                m = _LAYER.match(local)
                if m and m[2].endswith("._extra_state"):
                    key = f"decoder.layers.{m[2]}/shard_0_{layers}"
                elif m:
                    key = "decoder.layers." + name_key(f"decoder.layers.0.{m[2]}")[len("decoder.layers.0.") :]
                elif local.endswith("._extra_state") or (local == "output_layer.weight" and tied):
                    continue  # written by the layout itself (the tied copy only where the stage needs it)
                else:
                    key = local
                if key not in keys:
                    keys.append(key)
        self.keys = keys
        self.has_rng = obj0.get("rng_state") is not None
        self.label, self.none = "each rank file's rng_state", "no rng_state in its rank files"

    def rng(self, p: int, t: int, pp: int, tp: int):
        f = self._files.get((t, p))
        return self._rng(f) if f is not None else None

    def _rng(self, f: Path):
        obj = pr.load(f).obj
        rng = obj.get("rng_state") if isinstance(obj, dict) else None
        return None if rng is None else _rng_list(rng, "rng_state", f)

    def check_rng(self) -> None:
        for f in self._files.values():
            self._rng(f)


#: what Megatron's legacy load reads from an entry of a rank file's `rng_state` list (`[0]`, or its DP rank's)
_RNG_FIELDS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def _what(obj: Any) -> str:
    return f"a {type(obj).__name__}" + (f" of {len(obj)}" if isinstance(obj, (list, tuple, dict)) else "")


def _bad_rng(what: str, found: str, where: Path, wrapped: bool = False):
    """`what` (an item or field of the file `where`) holds `found`, not an RNG state (`wrapped`: a torch_dist
    item, Megatron's ShardedObject holding [the list])."""
    shape = f"a list of dicts with {', '.join(_RNG_FIELDS)}"
    return CorruptCheckpoint(
        f"{what} is not the RNG state Megatron saves: {found}, where it saves {f'[{shape}]' if wrapped else shape}",
        path=where,
        hint=f"re-copy {where.name} from the run that saved it",
    )


def _rng_list(rng: Any, what: str, where: Path) -> Any:
    """`rng` as a legacy rank file's `rng_state` (a non-empty list of dicts holding what Megatron's load reads),
    or a one-line CorruptCheckpoint naming `what` (the item and its file)."""
    if not isinstance(rng, (list, tuple)) or not rng:
        raise _bad_rng(what, _what(rng), where)
    for i, entry in enumerate(rng):
        if not isinstance(entry, dict):
            raise _bad_rng(what, f"entry {i} is {_what(entry)}", where)
        missing = [f for f in _RNG_FIELDS if f not in entry]
        if missing:
            raise _bad_rng(what, f"entry {i} lacks {', '.join(missing)}", where)
    return rng


def _legacy_source(ck):
    return _LegacySource(ck) if ck.format == "megatron_legacy" else _DistSource(ck)


def _legacy_name(key: str) -> str:
    """The local-spec module name of a torch_dist key (the fused layer-norm names back to the layer's own)."""
    for local, fused in MEGATRON_FUSED_NORMS:
        if key.startswith(fused):
            return local + key[len(fused) :]
    return key


#: a local-spec decoder layer's modules in the order Megatron-core's TransformerLayer registers them (so its
#: state_dict, and a legacy rank file's `model`, lists them): the layer norms under their fused torch_dist names
_MODULES = (
    "self_attention.linear_qkv.layer_norm_",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "mlp.linear_fc1.layer_norm_",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
)
_PARAMS = ("weight", "bias", "_extra_state")


def _module_rank(rest: str) -> tuple[int, int] | None:
    """Where a layer's tensor (`self_attention.linear_proj.bias`) comes in Megatron's module order; None if unknown."""
    for i, prefix in enumerate(_MODULES):
        if rest.startswith(prefix) and rest[len(prefix) :] in _PARAMS:
            return i, _PARAMS.index(rest[len(prefix) :])
    return None


def _stage_layout(keys: list[str], args: dict[str, Any], pp: int, vpp: int) -> dict[tuple[int, int], list]:
    """{(stage, chunk): [(local legacy name, global logical name or None for an extra state)]} in the order
    Megatron's GPTModel.state_dict lists them: the embedding (first chunk of stage 0), each layer's modules in the
    order the torch_dist .metadata lists them (the sharded state dict walks the same modules), the final norm and
    output layer (last chunk of the last stage)."""
    layers = int(args["num_layers"])
    chunks = max(vpp, 1)
    per = layers // (pp * chunks)
    pre, layer, post = [], [], []
    for k in keys:
        if k.startswith(("optimizer.", "rng_state/")):
            continue
        m = _EXTRA.match(k)
        if m:
            rest = m[1] + "._extra_state"
        elif k.startswith("decoder.layers."):
            rest = k[len("decoder.layers.") :]
        else:
            (pre if k.startswith("embedding.") else post).append(k)
            continue
        if rest not in layer:
            layer.append(rest)
    if all(_module_rank(r) is not None for r in layer):  # a distributed-optimizer save lists them otherwise
        layer.sort(key=_module_rank)
    tied = not args.get("untie_embeddings_and_output_weights")
    if "output_layer.weight" not in post and (pp > 1 and tied):
        post.append("output_layer.weight")  # the last stage's copy of the tied word embeddings
    out: dict[tuple[int, int], list] = {}
    for p in range(pp):
        for c in range(chunks):
            items = []
            if p == 0 and c == 0:
                items += [(k, k) for k in pre]
            start = c * pp * per + p * per
            for i in range(per):
                for rest in layer:
                    local = f"decoder.layers.{i}.{_legacy_name(rest)}"
                    extra = rest.endswith("._extra_state")
                    items.append((local, None if extra else name_key(f"decoder.layers.{start + i}.{rest}")))
            if p == pp - 1 and c == chunks - 1:
                for k in post:
                    src = "embedding.word_embeddings.weight" if (k == "output_layer.weight" and tied) else k
                    items.append((k, src))
                items.append(("output_layer._extra_state", None))
            out[(p, c)] = items
    return out


def _tp_shard(name: str, t, rank: int, tp: int, swiglu: bool):
    """Rank `rank`'s share of the whole tensor `t` of the local-spec parameter `name` at TP `tp` (the inverse of
    `formats.megatron_lm._rule`'s merge)."""
    rule = _rule(name, swiglu)
    if tp > 1 and rule not in ("replicated", "cat:0", "cat:1", "cat_sub:0"):
        raise UnsupportedCheckpoint(
            f"{name}: no TP split rule (Megatron-core GPT local spec): ckpt will not guess how to split it"
        )
    return split_shard(rule, t, rank, tp)  # SwiGLU fc1 (cat_sub:0): [gate; up], each split over the ranks


def _raw(t):
    """A tensor's bytes (a view of them when it is contiguous)."""
    import torch  # lazy: torch only when tensors are written; write/ stays torch-free at import

    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


class _Records:
    """Tensors of one rank file as `torch_zip` records: storage keys numbered in pickle order; the bytes kept (small
    values) or made when the file's writer reaches them (`made`: the weights and optimizer states)."""

    def __init__(self):
        self.data: dict[str, Any] = {}

    def _record(self, dtype, shape, data):
        key = str(len(self.data))
        self.data[key] = data
        return tensor_record(str(dtype).replace("torch.", ""), tuple(shape), key)

    def add(self, t):
        return self._record(t.dtype, t.shape, _raw(t))

    def made(self, like, make: Callable[[], Any]):
        """A tensor shaped and typed as `like` (a meta tensor) whose bytes `make()` returns when written."""
        return self._record(like.dtype, like.shape, lambda: _raw(make()))

    def tree(self, obj: Any) -> Any:
        """An inert tree (the RNG state) with every tensor re-recorded under this file's storage keys."""
        if isinstance(obj, TensorRef):
            return self.add(obj.read_torch())
        if isinstance(obj, dict):  # dict or OrderedDict, as saved
            return type(obj)((k, self.tree(v)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self.tree(v) for v in obj]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(self.tree(v) for v in obj)
        return obj


_BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(torch\.(\w+), "
    r"torch\.(\w+)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
)


def _distopt_buckets(ck) -> dict[tuple[int, int, str, str], dict[str, list[Any]]]:
    """{(domain, gbuf, param dtype, main dtype): {state: its buckets' TensorNodes, in bucket order}} of a torch_dist
    distributed-optimizer save (dp_reshardable; domain: Megatron's DP-group index, the model-parallel rank
    tp + TP x pp); refuses, in one line, buckets that are not numbered 0..n-1 or lack a state."""
    it = _dist_iter(ck)
    found: dict[tuple[int, int, str, str], dict[str, dict[int, Any]]] = {}
    for key, node in _flat(dcp_format.open(it).tree.children.get("model")).items():
        if not key.startswith("optimizer.distributed.") or "/" in key or not hasattr(node, "pieces"):
            continue
        m = _BUCKET.match(key)
        if m is None:
            raise UnsupportedCheckpoint(f"{key}: not a bucket of Megatron's dp_reshardable layout", path=it)
        found.setdefault((int(m[1]), int(m[2]), m[3], m[4]), {}).setdefault(m[6], {})[int(m[5])] = node
    out: dict[tuple[int, int, str, str], dict[str, list[Any]]] = {}
    for k, states in found.items():
        if set(states) != {"param", "exp_avg", "exp_avg_sq"} or any(
            sorted(b) != list(range(len(b))) or len(b) != len(states["param"]) for b in states.values()
        ):
            raise UnsupportedCheckpoint(
                f"distributed-optimizer buffer {k}: its buckets are not param, exp_avg and "
                "exp_avg_sq each numbered 0..n-1",
                path=it,
            )
        out[k] = {state: [b[i] for i in range(len(b))] for state, b in states.items()}
    if not out:
        raise UnsupportedCheckpoint(
            "no complete distributed-optimizer buckets (param, exp_avg, exp_avg_sq) in the torch_dist save", path=it
        )
    return out


def _write_distrib_optim(buckets: dict[tuple[int, int, str, str], dict[str, Any]], dst: Path, domain: int) -> int:
    """distrib_optim.pt as Megatron core_v0.16.1's legacy save of the distributed optimizer writes it
    (`get_parameter_state_dp_zero`): {"buckets_coalesced": True, gbuf: {(param dtype, main dtype): {param, exp_avg,
    exp_avg_sq, numel_unpadded}}}, each tensor the buffer's buckets cut to their unpadded length and joined (the
    torch_dist bucket tensors, back to back). Its bytes are copied file range to file range from the .distcp
    files (no buffer in memory); where the pieces cannot be copied as they are, the buffer is read when written."""
    import torch  # lazy: torch only when tensors are written; write/ stays torch-free at import

    fds = FdCache()
    rec = _Records()
    obj: dict[Any, Any] = {"buckets_coalesced": True}
    for (d, g, pdt, mdt), states in sorted(buckets.items()):
        if d != domain:
            continue
        n = sum(b.shape[0] for b in states["param"])
        entry: dict[str, Any] = {}
        for k in ("param", "exp_avg", "exp_avg_sq"):
            nodes = states[k]  # the buffer's buckets, joined in order
            like = torch.empty((n,), dtype=getattr(torch, nodes[0].dtype), device="meta")
            parts = [source_ranges(node, fds) for node in nodes]
            if all(r is not None for r in parts) and len({node.dtype for node in nodes}) == 1:
                entry[k] = rec._record(like.dtype, like.shape, tuple(x for r in parts for x in r))
            else:
                entry[k] = rec.made(like, lambda nodes=nodes: torch.cat([read_tensor(node) for node in nodes]))
        entry["numel_unpadded"] = n
        obj.setdefault(g, {})[(DType(pdt), DType(mdt))] = entry  # written as the torch.<dtype> globals
    try:
        return save(obj, dst, rec.data)
    finally:
        fds.close()


def legacy_rank_dirs(plan) -> list[tuple[str, int]]:
    """The rank folders `_write_legacy` writes for `plan`, in its order: (`iter_N/mp_rank_TT[_PPP]`, the bytes of
    the plan it counts for it). A torchrun job's units (`ops.convert`): each folder depends on the plan alone."""
    ck = L.open_any(plan.source)
    saved, saved_pp = ck.topology.tp or 1, ck.topology.pp or 1
    tp, pp = plan.tp or saved, plan.pp or saved_pp
    iteration = int(_legacy_source(ck).common["iteration"])
    n = pp * tp
    return [
        (f"iter_{iteration:07d}/{_dir_name(k % tp, k // tp, pp)}", plan.nbytes * (k + 1) // n - plan.nbytes * k // n)
        for k in range(n)
    ]


class _LegacyRun:
    """What every rank file of one legacy write shares: the source (`_legacy_source`), its args and common tree,
    the sizes saved and written, each stage's modules, the whole tensors by name, the param groups (with the step)
    and, for the distributed optimizer, its buckets. `rank_file(p, t)` builds one rank file's tree."""

    def __init__(self, plan):
        ck = L.open_any(plan.source)
        self.plan = plan
        self.args = args = _args(ck)
        self.src_of = _legacy_source(ck)
        self.common = common = self.src_of.common
        self.saved, self.saved_pp, self.vpp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.vpp or 0
        self.tp, self.pp = plan.tp or self.saved, plan.pp or self.saved_pp
        self.dp = int(args.get("data_parallel_size") or 1)
        self.swiglu = bool(args.get("swiglu"))
        self.layout = _stage_layout(self.src_of.keys, args, self.pp, self.vpp)
        self.module = {name_key(t.name): t for t in L.model_tensors(ck, weights="module")}
        self.params = {name_key(p.name): p for p in plan.params}
        self.group_of = {name_key(n): gi for gi, g in enumerate(plan.groups) for n in g["params"]}
        self.distopt = bool(args.get("use_distributed_optimizer"))
        self.buckets = None
        if self.distopt:  # the param groups (with the step) are a sharded object; the state is in the buckets
            self.groups_hp, self.step = _sharded_param_groups(_dist_iter(ck)), None
            self.buckets = _distopt_buckets(ck)  # the DCP's bucket tensors, found once for every rank file
        else:
            opt = common["optimizer"]["optimizer"]
            self.step = opt["state"]["common_step"].read_torch()
            self.groups_hp = [g for g in opt["param_groups"]]

    def source(self, name: str, what: str):
        """(the logical tensor, the dtype read) of one whole tensor of the source: "module", "fp32" or a state."""
        if what == "module":
            if name not in self.module:
                raise UnsupportedCheckpoint(f"{name}: not in the checkpoint's model", path=self.plan.source)
            return self.module[name], None
        if what == "fp32":
            return self.params[name].weight, "float32"
        return self.params[name].states[what], None

    def shard(self, rec: _Records, local: str, name: str, what: str, t: int):
        """TP rank t's shard of one whole tensor, as a record: shaped by splitting an empty (meta) tensor now, read
        and split when the rank file's writer reaches it (memory: one whole tensor and its shard)."""
        import torch  # lazy: torch only when tensors are written; write/ stays torch-free at import

        tp, swiglu = self.tp, self.swiglu
        node, dtype = self.source(name, what)
        like = torch.empty(node.shape, dtype=L.torch_dtype(dtype or node.dtype), device="meta")
        return rec.made(
            _tp_shard(local, like, t, tp, swiglu),
            lambda: _tp_shard(local, node.read(L.torch_dtype(dtype) if dtype else None), t, tp, swiglu),
        )

    def _rank_args(self, t: int, p: int):
        """The saved args of rank (t, p): ckpt_format torch, its rank, and the new sizes where they change."""
        tp, pp, dp = self.tp, self.pp, self.dp
        a = copy.copy(self.common["args"])
        rank = t + tp * dp * p  # Megatron's default rank order (tp-cp-ep-dp-pp), data-parallel rank 0
        state = {**self.common["args"].state, "ckpt_format": "torch", "use_dist_ckpt": False}
        for k in ("rank", "local_rank"):
            if k in state:
                state[k] = rank
        if (tp, pp) != (self.saved, self.saved_pp):
            state.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp * dp)
            if "transformer_pipeline_model_parallel_size" in state:
                state["transformer_pipeline_model_parallel_size"] = pp
        a.state = state
        return a

    def _models(self, rec: _Records, obj: dict, chunks: list, t: int) -> list[list]:
        """Each chunk's `model` of rank t's stage into `obj` (shards recorded in module order); returns the
        (local name, name) of the parameters of each param group, in that order."""
        members: list[list] = [[] for _ in self.groups_hp]
        for c, items in enumerate(chunks):
            m = collections.OrderedDict()
            for local, name in items:
                if name is None:
                    m[local] = None
                    continue
                m[local] = self.shard(rec, local, name, "module", t)
                if name in self.params and self.params[name].states:
                    if name not in self.group_of:
                        raise UnsupportedCheckpoint(f"{name}: in no param group", path=self.plan.source)
                    members[self.group_of[name]].append((local, name))
            obj[f"model{c}" if self.vpp else "model"] = m
        return members

    def _optimizer(self, rec: _Records, members: list[list], t: int) -> dict:
        """Rank t's `optimizer`: Adam's state per parameter id (numbered group after group) and the fp32 masters,
        or, for the distributed optimizer, the param groups alone (its state goes to distrib_optim.pt)."""
        state_out: dict[int, Any] = {}
        masters: list[list[Any]] = []
        ids: list[list[int]] = []
        i = 0
        for gi, mem in enumerate(members):
            ids.append(list(range(i, i + len(mem))))
            for local, name in [] if self.distopt else mem:
                state_out[i] = {
                    "step": rec.add(self.step.clone()),
                    **{k: self.shard(rec, local, name, k, t) for k in ("exp_avg", "exp_avg_sq")},
                }
                i += 1
        for gi, mem in enumerate([] if self.distopt else members):
            masters.append([self.shard(rec, local, name, "fp32", t) for local, name in mem])
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": ids[gi]} for gi, g in enumerate(self.groups_hp)
        ]
        if self.distopt:  # what Megatron's legacy save of the distributed optimizer keeps in the rank file
            return {"optimizer": {"param_groups": rec.tree(self.groups_hp)}}
        return {"optimizer": {"state": state_out, "param_groups": groups}, "fp32_from_fp16_params": masters}

    def rank_file(self, p: int, t: int, chunks: list) -> tuple[dict[str, Any], _Records]:
        """(the tree of rank (t, p)'s model_optim_rng.pt, the records of its tensors)."""
        common, tp, pp, saved, saved_pp = self.common, self.tp, self.pp, self.saved, self.saved_pp
        rec = _Records()
        obj: dict[str, Any] = {
            "args": self._rank_args(t, p),
            "checkpoint_version": common["checkpoint_version"],
            "iteration": common["iteration"],
        }
        members = self._models(rec, obj, chunks, t)
        obj["optimizer"] = self._optimizer(rec, members, t)
        obj["opt_param_scheduler"] = common["opt_param_scheduler"]
        src_t = t * saved // tp
        src_p = p * saved_pp // pp  # the saved stage of this stage's first layer (even stages: no VPP here)
        rng = self.src_of.rng(src_p, src_t, saved_pp, saved)
        if rng is not None:
            obj["rng_state"] = rec.tree(rng)
        obj["num_floating_point_operations_so_far"] = common.get("num_floating_point_operations_so_far")
        return obj, rec


def _write_legacy(
    plan, root: Path, progress: Callable[[int], None] | None, only: list[int] | None = None, common: bool = True
) -> int:
    """Write Megatron's legacy run folder for `plan` (to="megatron", ckpt_format="torch") into the empty folder
    `root`: one model_optim_rng.pt per (TP, PP) rank at `plan.tp`; returns the bytes written. Each tensor's bytes
    are read, split and written when the rank file's writer reaches them, so memory holds one whole tensor and its
    shard (plus the RNG state and the pickle); each rank reads the whole tensors it takes a shard of, so a stage is
    read once per TP rank written (TP x the reads). `only`: the rank folders (indices into `legacy_rank_dirs`) to
    write, each by itself the same bytes (a torchrun job's share); `common`: the iteration file."""
    run = _LegacyRun(plan)
    tp, pp = run.tp, run.pp
    iteration = int(run.common["iteration"])
    itdir = root / f"iter_{iteration:07d}"
    written = 0
    for p in range(pp):
        chunks = [run.layout[(p, c)] for c in range(max(run.vpp, 1))]
        for t in range(tp):
            if only is not None and p * tp + t not in only:
                continue
            obj, rec = run.rank_file(p, t, chunks)
            d = itdir / _dir_name(t, p, pp)
            d.mkdir(parents=True, exist_ok=only is not None)  # a job's rerun writes an unfinished folder over
            written += save(obj, d / "model_optim_rng.pt", rec.data)
            if run.distopt:
                written += _write_distrib_optim(run.buckets, d / "distrib_optim.pt", t + tp * p)
            if progress:  # in the plan's units (the source's bytes): its share per rank file written
                k, n = p * tp + t, pp * tp
                progress(plan.nbytes * (k + 1) // n - plan.nbytes * k // n)
    if common:  # a job's shares leave it to rank 0's finish
        (root / LATEST).write_text(str(iteration))
    return written
