"""How tensor-parallel (TP) shards of a parameter form the logical tensor — and who said so.

A TP checkpoint stores every parameter once per TP rank. Some are *replicated* (every rank holds the
whole tensor: layer norms, the bias added after a row-parallel all-reduce, learned position
embeddings), others are *split* (column-parallel and vocabulary-parallel weights along dim 0,
row-parallel weights along dim 1). The files do not say which: an evenly split shard has the same shape
on every rank, just like a replica. Getting it wrong is silent — concatenating two replicas of a layer
norm gives a tensor of twice the size that loads nowhere, or worse, a row-parallel weight concatenated
on dim 0 has the right numel and the wrong values.

So every merge rule here carries its `source`:

- ``universal_checkpoint_info`` — the patterns a Megatron-DeepSpeed run saves in its model states
  (`TPLayout.from_checkpoint_info`). Semantics are DeepSpeed's own (`deepspeed/checkpoint/
  ds_to_universal.py: merge_tp_slices`): patterns are `re.match`ed (anchored at the start only) against
  DeepSpeed's parameter names ("2.input_layernorm.weight"); the first category that matches wins, in
  the order replicated, average, 2-sub-params cat dim 0, sub-params, row-parallel (cat dim 1); anything
  else is concatenated on dim 0. Vocabulary patterns only add "strip the padding rows".
- ``megatron preset`` — the Megatron-LM / Megatron-DeepSpeed / BLOOM naming convention
  (`TPLayout.megatron_preset`), for checkpoints that carry no such info. Names it does not know get no
  rule (``None``) instead of a guess.
- ``user pattern`` — explicit `REGEX[=MERGE]` overrides (`TPLayout.from_user_patterns`), asked first.
- ``data`` — when nothing else decides and the caller hands over the shards: bit-identical shards of
  equal shape are replicated (`rule_from_data`). Reading shards costs I/O, so this is opt-in.

Merge rules (the strings `TensorNode.merge` carries):

- ``"replicated"``: every rank holds the full tensor; TP rank 0's copy is the logical one.
- ``"cat:<d>"``: concatenate the shards along dim d.
- ``"average"``: the logical tensor is the mean of the shards (DeepSpeed's `parameter_to_average`).
- ``"cat_sub:<d>"``: the parameter packs several sub-parameters along dim d (SwiGLU's fused
  `dense_h_to_4h`); each shard holds its slice of every sub-parameter, so slices are concatenated per
  sub-parameter, then the sub-parameters one after another. `Rule.sub_params` gives their count.

`merge_shards(rule, tensors)` materialises any of them; `TensorNode.read_torch` handles the first two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from .qkv import megatron_qkv

# The keys of DeepSpeed's universal_checkpoint_info (deepspeed/checkpoint/constants.py), spelled out here
# so that reading a checkpoint never imports deepspeed.
TP_REPLICATED = "tp_replicated_parameter_patterns"
TO_AVERAGE = "parameter_to_average_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
TWO_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
PIPELINE_REPLICATED = "pipeline_replicated_parameter_patterns"
AFFINE_MAP = "affine_map"

SOURCE_INFO = "universal_checkpoint_info"
SOURCE_PRESET = "megatron preset"
SOURCE_USER = "user pattern"
SOURCE_DATA = "data"

MERGES = ("replicated", "average", "cat:0", "cat:1")


def _is_merge(merge: str) -> bool:
    return merge in MERGES or bool(re.fullmatch(r"cat(?:_sub)?:\d+", merge))


@dataclass(frozen=True)
class Rule:
    """How one parameter's TP shards merge, and why.

    `merge` is None when no source could decide. `pattern` is the regex that matched (None for a
    default or a data decision). `vocab_size` is set for vocabulary-parallel tensors whose padding rows
    beyond it are not part of the model (DeepSpeed strips them when converting to universal).
    """

    merge: str | None
    source: str
    pattern: str | None = None
    sub_params: Any = None  # number of sub-parameters (or their sizes) for "cat_sub:<d>"
    vocab_size: int | None = None
    note: str | None = None

    @property
    def cat_dim(self) -> int | None:
        if self.merge and self.merge.startswith(("cat:", "cat_sub:")):
            return int(self.merge.rsplit(":", 1)[1])
        return None

    def describe(self) -> str:
        how = self.merge or "unknown"
        why = self.source + (f" /{self.pattern}/" if self.pattern else "")
        return f"{how} ({why})"


@dataclass(frozen=True)
class _Category:
    merge: str
    patterns: tuple[str, ...]
    sub_params: Any = None


_UNDECIDED = object()


@dataclass(frozen=True)
class TPLayout:
    """Merge rules for the parameters of one checkpoint. Ask `rule(name)` per parameter.

    Layouts compose: `user.then(info)` asks `user` first and falls back to `info`. Within one layout the
    categories are tried in order (the order is DeepSpeed's, see the module docstring) and the first
    matching one wins; `default` applies when none matches (DeepSpeed's info: cat dim 0; the preset:
    no rule).
    """

    source: str
    categories: tuple[_Category, ...] = ()
    default: str | None = None
    vocabulary: tuple[str, ...] = ()
    vocab_size: int | None = None
    pipeline_replicated: tuple[str, ...] = ()
    match: str = "match"  # "match" (re.match, DeepSpeed's way) or "search"
    unsupported: tuple[str, ...] = ()  # patterns of rules this reader cannot apply (DeepSpeed affine maps)
    fallback: "TPLayout | None" = None
    info: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # --- constructors -------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint_info(cls, info: Mapping[str, Any]) -> "TPLayout":
        """The rules a `universal_checkpoint_info` dict (from DeepSpeed model states) declares."""
        info = dict(info or {})

        def pats(key: str) -> tuple[str, ...]:
            v = info.get(key) or []
            return tuple(str(p) for p in v) if isinstance(v, (list, tuple)) else ()

        cats = [
            _Category("replicated", pats(TP_REPLICATED)),
            _Category("average", pats(TO_AVERAGE)),
            _Category("cat_sub:0", pats(TWO_SUB_PARAMS_CAT_DIM_0), 2),
        ]
        for spec in info.get(SUB_PARAMS) or []:
            # SubparamShape(patterns, shape, partition_dim): shape[partition_dim] lists the sub-params
            if isinstance(spec, Mapping):
                dim = int(spec.get("partition_dim", 0))
                shape = spec.get("shape") or ()
                subs = shape[dim] if dim < len(shape) else None
                cats.append(_Category(f"cat_sub:{dim}", tuple(map(str, spec.get("patterns") or ())), subs))
        cats.append(_Category("cat:1", pats(ROW_PARALLEL)))
        affine = info.get(AFFINE_MAP)
        unsupported = (
            tuple(map(str, affine.get("params", {})))
            if isinstance(affine, Mapping) and isinstance(affine.get("params"), Mapping)
            else ()
        )
        vocab = info.get("original_vocab_size")
        return cls(
            SOURCE_INFO,
            tuple(c for c in cats if c.patterns),
            default="cat:0",
            vocabulary=pats(VOCABULARY),
            vocab_size=int(vocab) if isinstance(vocab, int) else None,
            pipeline_replicated=pats(PIPELINE_REPLICATED),
            unsupported=unsupported,
            info=info,
        )

    @classmethod
    def megatron_preset(cls, *, swiglu: bool = False) -> "TPLayout":
        """Megatron-LM / Megatron-DeepSpeed / BLOOM parameter names, legacy and megatron.core spellings.

        Works on DeepSpeed pipeline names ("2.input_layernorm.weight", the final norm layer's bare
        "6.weight") and on full module paths ("language_model.encoder.layers.0.input_layernorm.weight").
        With `swiglu`, `dense_h_to_4h` / `linear_fc1` pack two sub-parameters (gate, up) along dim 0.
        """
        end = r"(?:^|\.)"
        replicated = (
            end + r"(?:input_layernorm|post_attention_layernorm|pre_mlp_layernorm|post_inter_attention_layernorm"
            r"|final_layernorm|final_norm|ln_f|word_embeddings_layernorm|embedding_layernorm"
            r"|k_layernorm|q_layernorm)\.(?:weight|bias)$",
            r"^\d+\.(?:weight|bias)$",  # a pipeline layer that is a bare LayerNorm: the final norm
            end + r"(?:self_attention|attention|inter_attention)\.dense\.bias$",
            end + r"(?:mlp\.dense_4h_to_h|linear_proj|linear_fc2)\.bias$",
            end + r"position_embeddings\.weight$",
            end + r"layer_norm_(?:weight|bias)$",  # Transformer Engine's fused norm in linear_qkv / linear_fc1
            end + r"mlp\.router\.(?:weight|expert_bias)$",  # Megatron-core MoE's router: TP-replicated
        )
        row = (
            end + r"(?:self_attention|attention|inter_attention)\.dense\.weight$",
            end + r"(?:mlp\.dense_4h_to_h|linear_proj|linear_fc2)\.weight$",
        )
        fc1 = end + r"(?:dense_h_to_4h|linear_fc1)\.(?:weight|bias)$"
        column = (
            end + r"(?:query_key_value|linear_qkv|query|key_value)\.(?:weight|bias)$",
            end + r"(?:word_embeddings|lm_head|output_layer)\.weight$",
        )
        cats = [_Category("replicated", replicated)]
        if swiglu:
            cats.append(_Category("cat_sub:0", (fc1,), 2))
        cats += [_Category("cat:1", row), _Category("cat:0", column + (() if swiglu else (fc1,)))]
        return cls(
            SOURCE_PRESET,
            tuple(cats),
            default=None,
            vocabulary=(end + r"(?:word_embeddings|lm_head|output_layer)\.weight$",),
            match="search",
        )

    @classmethod
    def from_user_patterns(cls, specs: Iterable[str]) -> "TPLayout":
        """Explicit overrides, `REGEX=MERGE` (MERGE: replicated, average, cat:0, cat:1, ...) or a bare
        `REGEX`, which means replicated (the usual fix: "these are replicas"). Patterns are `re.search`ed;
        the first one that matches wins. Raises ValueError naming a bad spec before any work starts."""
        cats = []
        for spec in specs:
            regex, _, merge = str(spec).rpartition("=")
            if not regex or not _is_merge(merge.strip()):
                # no "=MERGE" suffix (a regex may contain "=" itself, as in a lookahead): replicated
                if regex and re.fullmatch(r"[a-z_]+(?::\d+)?", merge.strip()):
                    raise ValueError(
                        f"--pattern {spec!r}: unknown merge {merge.strip()!r} "
                        "(use replicated, average, cat:0, cat:1, cat_sub:0)"
                    )
                regex, merge = str(spec), "replicated"
            merge = merge.strip()
            try:
                re.compile(regex)
            except re.error as e:
                raise ValueError(f"--pattern {spec!r}: bad regex ({e})") from None
            cats.append(_Category(merge, (regex,), 2 if merge.startswith("cat_sub") else None))
        return cls(SOURCE_USER, tuple(cats), default=None, match="search")

    @classmethod
    def for_checkpoint(
        cls, info: Mapping[str, Any] | None, *, user_patterns: Sequence[str] = (), swiglu: bool = False
    ) -> "TPLayout":
        """The layout a reader should use: user overrides first, then the checkpoint's own info if it
        has any, else the Megatron preset."""
        base = cls.from_checkpoint_info(info) if info else cls.megatron_preset(swiglu=swiglu)
        return cls.from_user_patterns(user_patterns).then(base) if user_patterns else base

    def then(self, fallback: "TPLayout") -> "TPLayout":
        """This layout, asking `fallback` for names it has no rule for."""
        tail = fallback if self.fallback is None else self.fallback.then(fallback)
        return replace(self, fallback=tail)

    # --- queries --------------------------------------------------------------------------------------

    @property
    def sources(self) -> tuple[str, ...]:
        """Every source in the chain, first asked first (e.g. ("user pattern", "megatron preset"))."""
        return (self.source,) + (self.fallback.sources if self.fallback else ())

    def _hit(self, pattern: str, name: str) -> bool:
        return bool((re.match if self.match == "match" else re.search)(pattern, name))

    def rule(self, name: str, shards: Sequence[Any] | None = None) -> Rule:
        """The merge rule for parameter `name`. With `shards` (TensorRefs or TensorNodes, one per TP
        rank) a name no pattern decides is decided from the data (`rule_from_data`). The patterns' answer
        is remembered per name (a pipeline checkpoint asks for every tensor of every TP rank)."""
        cache = self.__dict__.get("_rules")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_rules", cache)
        hit = cache.get(name)
        if hit is None:
            hit = cache[name] = self._pattern_rule(name)
        rule, decided = hit
        if not decided and shards is not None:
            return rule_from_data(shards)
        return rule

    def _pattern_rule(self, name: str) -> tuple[Rule, bool]:
        r = self._rule(name, _UNDECIDED)
        return (Rule(None, self.source, note="no pattern matched"), False) if r is _UNDECIDED else (r, True)

    def _rule(self, name: str, undecided: Any) -> Any:
        vocab = self.vocab_size if any(self._hit(p, name) for p in self.vocabulary) else None
        for p in self.unsupported:
            if self._hit(p, name):
                return Rule(
                    None, self.source, p, note="described by a DeepSpeed affine map, which this reader does not apply"
                )
        for cat in self.categories:
            for p in cat.patterns:
                if self._hit(p, name):
                    return Rule(cat.merge, self.source, p, cat.sub_params, vocab)
        if self.fallback is not None:
            r = self.fallback.rule(name)
            if r.merge is not None:
                return r
        if self.default is not None:
            return Rule(self.default, self.source, None, vocab_size=vocab, note="no pattern matched: the default")
        return undecided  # no pattern and no default decides this name

    def is_pipeline_replicated(self, name: str) -> bool:
        """Tied weights held by several pipeline stages (DeepSpeed keeps the first stage's copy)."""
        return any(self._hit(p, name) for p in self.pipeline_replicated) or bool(
            self.fallback and self.fallback.is_pipeline_replicated(name)
        )

    def unused_patterns(self, names: Iterable[str]) -> list[str]:
        """Patterns that match none of `names` — DeepSpeed's strict `ds_to_universal` rejects those."""
        names = list(names)
        pats = [p for c in self.categories for p in c.patterns] + list(self.vocabulary)
        return sorted({p for p in pats if not any(self._hit(p, n) for n in names)})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (for `inspect --json` and reports)."""
        out = {
            "source": self.source,
            "match": self.match,
            "default": self.default,
            "categories": {c.merge: list(c.patterns) for c in self.categories},
            "vocabulary": list(self.vocabulary),
        }
        if self.fallback is not None:
            out["fallback"] = self.fallback.to_dict()
        return out


# --- deciding from the data ---------------------------------------------------------------------------


def _shard_bytes(shard: Any) -> bytes:
    """The raw bytes of one TP shard given as a TensorRef, a whole-tensor TensorNode, or a torch tensor."""
    ref = getattr(shard, "ref", None)
    pieces = getattr(shard, "pieces", None)
    if pieces is not None and len(pieces) == 1 and pieces[0].numel == pieces[0].ref.numel:
        ref = pieces[0].ref
    if ref is None and hasattr(shard, "read_numpy"):
        ref = shard
    if ref is not None:
        return ref.read_numpy().tobytes()
    t = shard.read_torch() if hasattr(shard, "read_torch") else shard
    return t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()


def rule_from_data(shards: Sequence[Any]) -> Rule:
    """Replicated if every shard has the same shape and dtype and identical bytes; otherwise undecided.

    Differing bytes do not tell split from drifted replicas, nor the split dim, so no cat rule is
    guessed. Reads every shard's bytes (one at a time, compared with the first).
    """
    if not shards:
        return Rule(None, SOURCE_DATA, note="no shards")
    shapes = {tuple(s.shape) for s in shards}
    dtypes = {str(s.dtype) for s in shards}
    if len(shapes) > 1 or len(dtypes) > 1:
        return Rule(None, SOURCE_DATA, note=f"shards differ in shape/dtype: {sorted(shapes)} {sorted(dtypes)}")
    first = _shard_bytes(shards[0])
    if all(_shard_bytes(s) == first for s in shards[1:]):
        return Rule("replicated", SOURCE_DATA, note="all TP shards are bit-identical")
    return Rule(None, SOURCE_DATA, note="TP shards differ: split, or drifted replicas")


# --- applying a rule ------------------------------------------------------------------------------------


def merged_shape(rule_or_merge: Rule | str | None, shard_shape: Sequence[int], tp: int) -> tuple[int, ...]:
    """The logical shape from one shard's shape (shards of a parameter have equal shapes)."""
    merge = rule_or_merge.merge if isinstance(rule_or_merge, Rule) else rule_or_merge
    shape = list(shard_shape)
    if merge and merge.startswith(("cat:", "cat_sub:")):
        d = int(merge.rsplit(":", 1)[1])
        if d >= len(shape):
            raise ValueError(f"cannot concatenate a tensor of shape {tuple(shard_shape)} on dim {d}")
        shape[d] *= tp
    return tuple(shape)


def merge_shards(rule: Rule | str, tensors: Sequence[Any]):
    """The logical tensor from the TP shards (torch tensors, TP rank order), for every merge rule."""
    import torch  # lazy: torch only when shards are merged; read/ is the torch-free core

    merge = rule.merge if isinstance(rule, Rule) else rule
    if merge == "replicated":
        return tensors[0]
    if merge == "average":
        return sum(tensors) / len(tensors)
    if merge and merge.startswith("cat:"):
        return torch.cat(list(tensors), dim=int(merge[4:]))
    if merge and merge.startswith("cat_sub:"):
        d = int(merge.rsplit(":", 1)[1])
        subs = rule.sub_params if isinstance(rule, Rule) and rule.sub_params else 2
        if isinstance(subs, (list, tuple)):  # explicit full sizes per sub-param: each shard holds size/tp
            sizes = [int(s) // len(tensors) for s in subs]
            chunks = [torch.split(t, sizes, dim=d) for t in tensors]
        else:
            chunks = [torch.chunk(t, int(subs), dim=d) for t in tensors]
        per_sub = [torch.cat([c[i] for c in chunks], dim=d) for i in range(len(chunks[0]))]
        return torch.cat(per_sub, dim=d)
    if merge and merge.startswith("megatron_qkv:"):  # a conversion's view: torchtitan's q/k/v as Megatron's
        return megatron_qkv(merge, list(tensors))
    raise ValueError(f"no merge rule ({merge!r}); pass --pattern REGEX=MERGE for this parameter")


def split_shard(rule: Rule | str, tensor: Any, rank: int, tp: int):
    """TP rank `rank`'s shard of the logical tensor at TP `tp`: the inverse of `merge_shards` for the rules a
    split can undo (replicated, `cat:d`, `cat_sub:d`), so `merge_shards(rule, [split_shard(rule, t, r, tp) for r in
    range(tp)])` is `t`. A copy, never a view of `tensor`."""
    import torch  # lazy: torch only when a shard is split; read/ is the torch-free core

    merge = rule.merge if isinstance(rule, Rule) else rule
    if tp == 1 or merge == "replicated":
        return tensor
    if merge and merge.startswith("cat:"):
        return tensor.chunk(tp, int(merge[4:]))[rank].contiguous()
    if merge and merge.startswith("cat_sub:"):  # each sub-parameter split over the ranks, this rank's slices joined
        d = int(merge.rsplit(":", 1)[1])
        subs = rule.sub_params if isinstance(rule, Rule) and rule.sub_params else 2
        parts = (
            torch.split(tensor, [int(x) for x in subs], dim=d)
            if isinstance(subs, (list, tuple))
            else tensor.chunk(int(subs), d)
        )
        return torch.cat([h.chunk(tp, d)[rank] for h in parts], dim=d).contiguous()
    raise ValueError(f"no split rule ({merge!r})")
