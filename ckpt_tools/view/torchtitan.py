"""A torchtitan Llama's DCP save (its CheckpointManager's) presented under Megatron-core's names (`titan_view`):
what `ckpt convert --to megatron` writes from and the logical diff compares the written run with
(`write.megatron_from_view`, `view.megatron_core`), and torchtitan's LR schedule (`--lr-scheduler`) as the factors
its LambdaLR gives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedCheckpoint
from ..read.qkv import megatron_rule
from ..read.tree import GroupNode, TensorNode, ValueNode
from . import logical as L
from .format_facts import is_dcp


def is_titan_view(ck) -> bool:
    """`ck` is a torchtitan source already read under Megatron-core names (`titan_view`); `is_torchtitan`: the
    save as read from disk, under torchtitan's own names."""
    return _VIEW in ck.details


def refuse(msg: str, ck, hint: str | None = None):
    raise UnsupportedCheckpoint(msg, path=Path(ck.path) if ck is not None else None, hint=hint)


# --- the way in from torchtitan (its Llama, a DCP save of its CheckpointManager) -------------------------------
#
# torchtitan's checkpoint holds no model config: the head counts, RoPE and norm settings come from the model's
# Hugging Face config.json (`--hf-config`, as `export --hf` takes it), checked against every tensor's shape. The
# source is read as a Megatron-core view (`titan_view`): the same DCP tree, its tensors under Megatron-core names,
# where Megatron fuses what torchtitan keeps apart the view's tensor is made from the parts at read time (a
# `TensorNode` whose shards are the parts: `linear_qkv` by `read.qkv.megatron_qkv`, per query group with q / k
# rows from torchtitan's interleaved RoPE pairs to Megatron's rotate-half order; SwiGLU `linear_fc1` = [w1; w3]).
# The writer, the plan and the logical diff all read that view.

#: torchtitan Llama name -> Megatron-core name ({}: the layer); the parts of one fused Megatron tensor in order
_TITAN = (
    (r"tok_embeddings\.weight", "embedding.word_embeddings.weight"),
    (
        r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?w(q|k|v|qkv)\.weight",
        "decoder.layers.{}.self_attention.linear_qkv.weight",
    ),
    (r"layers\.(\d+)\.attention\.wo\.weight", "decoder.layers.{}.self_attention.linear_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight"),
    (r"layers\.(\d+)\.feed_forward\.w(1|3)\.weight", "decoder.layers.{}.mlp.linear_fc1.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "decoder.layers.{}.mlp.linear_fc2.weight"),
    (r"norm\.weight", "decoder.final_layernorm.weight"),
    (r"(?:lm_head|output)\.weight", "output_layer.weight"),
)
_TITAN_RX = tuple((re.compile(p + "$"), core) for p, core in _TITAN)
_PART_ORDER = {"q": 0, "k": 1, "v": 2, "qkv": 0, "1": 0, "3": 1}
_VIEW = "megatron_in"  # ck.details key marking a torchtitan source read under Megatron-core names


def is_torchtitan_llama(names: list[str]) -> bool:
    """torchtitan's Llama parameter names: `tok_embeddings.weight` and `layers.N.attention.…wq.weight`."""
    return "tok_embeddings.weight" in names and any(
        re.search(r"^layers\.\d+\.attention\.(qkv_linear\.)?wq\.weight$", n) for n in names
    )


def is_torchtitan(ck) -> bool:
    """A torchtitan Llama DCP save (its model keys flat: `tok_embeddings.weight`, `layers.N.attention.…wq…`), as read
    from disk (`is_titan_view`: already under Megatron-core names)."""
    model = ck.tree.children.get("model")
    return is_dcp(ck) and isinstance(model, GroupNode) and is_torchtitan_llama(list(model.children))


def from_torchtitan(ck) -> bool:
    """`ck` is a torchtitan save, as read from disk or under Megatron-core names."""
    return is_torchtitan(ck) or is_titan_view(ck)


def _titan_core(name: str, ck) -> tuple[str, int]:
    """(Megatron-core name, the part's position in it) of a torchtitan name; refuses one it does not map."""
    for rx, core in _TITAN_RX:
        m = rx.match(name)
        if m:
            g = m.groups()
            return core.format(g[0]) if g else core, _PART_ORDER.get(g[1], 0) if len(g) > 1 else 0
    refuse(
        f"{name}: not a parameter of torchtitan's Llama (tok_embeddings, layers.N.attention / attention_norm / "
        "feed_forward / ffn_norm, norm, output): ckpt does not map it to Megatron-core",
        ck,
    )


def hf_cfg(ck) -> tuple[dict[str, Any], str]:
    path = ck.details.get("hf_config")
    if not path:
        refuse(
            "a torchtitan checkpoint holds no model config: --to megatron needs the model's Hugging Face "
            "config.json for the head counts, RoPE and norm settings",
            ck,
            hint="add --hf-config CONFIG.json (as for `ckpt export --hf`)",
        )
    return json.loads(Path(path).read_text()), path


def rope(cfg: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(RoPE base, its scaling or None) from a config.json: transformers 5's `rope_parameters` {rope_theta,
    rope_type, ...} or the older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        kind = params.get("rope_type") or params.get("type") or "default"
        return params.get("rope_theta", cfg.get("rope_theta")), (None if kind == "default" else params)
    scaling = cfg.get("rope_scaling") or None
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "default":
        scaling = None
    return cfg.get("rope_theta"), scaling


def titan_heads(cfg: dict[str, Any]) -> tuple[int, int]:
    heads = cfg.get("num_attention_heads")
    return heads, cfg.get("num_key_value_heads") or heads


def titan_view(
    ck,
    heads: int,
    groups: int,
    hf_config: str | None = None,
    seq_length: int | None = None,
    lr_scheduler: str | None = None,
    drop_norm_decay: bool = False,
):
    """The torchtitan checkpoint `ck` under Megatron-core names (see above), `heads` query heads in `groups` KV
    groups; `hf_config` / `seq_length` (the conversion's) kept in its details. `drop_norm_decay`
    (`--drop-norm-decay`): the 1-D tensors of a group that decays (torchtitan's stock `default_adamw`: one group,
    weight decay on every parameter) moved into a group of their own with weight decay 0, as Megatron-core's own
    rule groups them; the view then is what Megatron will train, and its details say what changed."""
    kids = ck.tree.children
    fuse = _Fuser(ck, heads, groups)
    model = {core: fuse.composed(core, parts) for core, parts in fuse.by_core(kids["model"].children.items()).items()}
    new = dict(kids)
    new["model"] = GroupNode(model)
    opt = kids.get("optimizer")
    dropped: list[tuple[float, int]] = []
    if isinstance(opt, GroupNode) and isinstance(opt.children.get("state"), GroupNode):
        new["optimizer"], dropped = _titan_optimizer(opt, model, fuse, drop_norm_decay)
    details = _titan_details(ck, heads, groups, hf_config, seq_length, lr_scheduler, drop_norm_decay, dropped)
    return dataclasses.replace(ck, tree=dataclasses.replace(ck.tree, children=new), details=details, state_split={})


@dataclasses.dataclass
class _Fuser:
    """Puts torchtitan's parts of one Megatron-core tensor together: a `TensorNode` whose shards are the parts
    (`linear_qkv` merged by `read.qkv.megatron_rule`, others concatenated on dim 0)."""

    ck: Any
    heads: int
    groups: int

    def __post_init__(self) -> None:
        self.rule = megatron_rule(self.heads, self.groups)

    def composed(self, core: str, parts: list[tuple[int, Any]]):
        heads, groups, ck = self.heads, self.groups, self.ck
        nodes = [n for _, n in sorted(parts, key=lambda x: x[0])]
        if len(nodes) == 1 and not core.endswith("linear_qkv.weight"):
            return nodes[0]
        if not all(isinstance(n, TensorNode) for n in nodes) or len({n.dtype for n in nodes}) > 1:
            refuse(f"{core}: its torchtitan parts are not tensors of one dtype", ck)
        if core.endswith("linear_qkv.weight"):
            rows = sum(n.shape[0] for n in nodes)
            if rows != (heads + 2 * groups) * (rows // (heads + 2 * groups)) or len(nodes) not in (1, 3):
                refuse(f"{core}: {rows} q/k/v rows do not fit {heads} heads in {groups} KV groups", ck)
            return TensorNode((rows, *nodes[0].shape[1:]), nodes[0].dtype, shards=tuple(nodes), merge=self.rule)
        return TensorNode(
            (sum(n.shape[0] for n in nodes), *nodes[0].shape[1:]), nodes[0].dtype, shards=tuple(nodes), merge="cat:0"
        )

    def by_core(self, items) -> dict[str, list[tuple[int, Any]]]:
        """{Megatron-core name: [(the part's position, its node)]} of torchtitan's (name, node) `items`."""
        out: dict[str, list[tuple[int, Any]]] = {}
        for name, node in items:
            core, at = _titan_core(name, self.ck)
            out.setdefault(core, []).append((at, node))
        return out


def _titan_optimizer(opt, model: dict, fuse: _Fuser, drop_norm_decay: bool) -> tuple[Any, list[tuple[float, int]]]:
    """(the optimizer node under Megatron-core names: each state fused as its parameter, the param groups' members
    renamed and in Megatron-core's order; what `--drop-norm-decay` dropped)."""
    ck = fuse.ck
    state = {}
    for core, parts in fuse.by_core(opt.children["state"].children.items()).items():
        keys = {k for _, e in parts for k in e.children}
        entry = {}
        for k in sorted(keys):
            got = [(at, e.children[k]) for at, e in parts if k in e.children]
            entry[k] = got[0][1] if k == "step" else fuse.composed(core, got)
        state[core] = GroupNode(entry)
    rename = {name: _titan_core(name, ck)[0] for name in opt.children["state"].children}
    groups_node = opt.children.get("param_groups")
    pg = {}
    for i, g in groups_node.children.items() if isinstance(groups_node, GroupNode) else ():
        members = g.children.get("params") if isinstance(g, GroupNode) else None
        if isinstance(members, ValueNode) and isinstance(members.value, list):
            names = list(dict.fromkeys(rename.get(n) or _titan_core(n, ck)[0] for n in members.value))
            g = GroupNode({**g.children, "params": ValueNode(names)})
        pg[i] = g

    def flat(g) -> bool:  # a group of 1-D tensors only: Megatron-core's no-decay group, which it puts last
        members = g.children.get("params") if isinstance(g, GroupNode) else None
        names = members.value if isinstance(members, ValueNode) and isinstance(members.value, list) else []
        return bool(names) and all(len(getattr(model.get(n), "shape", (0, 0))) == 1 for n in names)

    dropped: list[tuple[float, int]] = []
    if drop_norm_decay:
        pg, dropped = _split_decaying_norms(pg, model, ck)
    pg = {str(j): g for j, g in enumerate(sorted(pg.values(), key=flat))}  # Megatron-core's group order
    node = GroupNode({**opt.children, "state": GroupNode(state), **({"param_groups": GroupNode(pg)} if pg else {})})
    return node, dropped


def _titan_details(
    ck,
    heads: int,
    groups: int,
    hf_config: str | None,
    seq_length: int | None,
    lr_scheduler: str | None,
    drop_norm_decay: bool,
    dropped: list[tuple[float, int]],
) -> dict[str, Any]:
    """The view's details: the source's, less what the view settles, with the view's mark and the conversion's
    settings (`hf_config`, `seq_length`, `lr_scheduler`, the decay dropped)."""
    details = {k: v for k, v in ck.details.items() if k not in ("convert_unproven", "resume_unsupported", "fused")}
    details[_VIEW] = (
        f"torchtitan Llama read under Megatron-core names ({heads} heads, {groups} KV groups: q/k rows "
        "in rotate-half order, wq/wk/wv fused per query group, w1/w3 as linear_fc1)"
    )
    if hf_config:
        details["hf_config"] = str(hf_config)
    if drop_norm_decay:
        details["norm_decay_dropped"] = dropped
    if seq_length:
        details["seq_length"] = int(seq_length)
    if lr_scheduler:
        details["titan_schedule"] = str(lr_scheduler)
    return details


def _split_decaying_norms(pg: dict, model: dict, ck) -> tuple[dict, list[tuple[float, int]]]:
    """`--drop-norm-decay`: each param group that decays and holds 1-D tensors (norm weights) split into its
    other members, as they were, and its 1-D members with weight decay 0 (Megatron-core's wd_mult 0 group);
    [(the weight decay dropped, how many tensors)] per split group. Refuses when no group needs it."""
    out: dict = {}
    dropped: list[tuple[float, int]] = []
    for i, g in pg.items():
        members = g.children.get("params") if isinstance(g, GroupNode) else None
        wd = g.children.get("weight_decay") if isinstance(g, GroupNode) else None
        names = members.value if isinstance(members, ValueNode) and isinstance(members.value, list) else []
        decay = float(wd.value) if isinstance(wd, ValueNode) and isinstance(wd.value, (int, float)) else 0.0
        flat = [n for n in names if len(getattr(model.get(n), "shape", (0, 0))) == 1]
        if not decay or not flat:
            out[i] = g
            continue
        norms = set(flat)
        rest = [n for n in names if n not in norms]
        if rest:
            out[i] = GroupNode({**g.children, "params": ValueNode(rest)})
        out[f"{i}.norms"] = GroupNode({**g.children, "params": ValueNode(flat), "weight_decay": ValueNode(0.0)})
        dropped.append((decay, len(flat)))
    if not dropped:
        refuse(
            "--drop-norm-decay: no param group decays the norms (1-D tensors): nothing to drop",
            ck,
            hint="drop the flag",
        )
    return out, dropped


def read_config(ck, hf_config: str | Path) -> tuple[dict[str, Any], str]:
    """(the config.json at `hf_config`, its path): a plan's `--hf-config`, found and checked against the
    checkpoint when the plan was made (the conversion's own reader, `ops.convert_megatron.read_checked_config`)."""
    path = Path(hf_config)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedCheckpoint(
            f"--hf-config: cannot read it ({e})", path=path, hint="pass a JSON config.json"
        ) from None
    return cfg, str(path)


#: reads the config.json `--hf-config` names for a torchtitan checkpoint: (config, its path)
ConfigReader = Callable[[Any, str], tuple[dict[str, Any], str]]


def source_view(
    ck,
    hf_config: str | None = None,
    seq_length: int | None = None,
    lr_scheduler: str | None = None,
    drop_norm_decay: bool = False,
    *,
    n_kv_heads: int | None = None,
    read: ConfigReader = read_config,
):
    """What the conversion into Megatron reads: a torchtitan source as `titan_view` (its heads from the
    `--hf-config` given, read by `read`, which checks every shape against it), any other source as it is.
    `n_kv_heads` (`--n-kv-heads`) is refused for a torchtitan source: its KV heads are the config's."""
    if n_kv_heads is not None and is_torchtitan(ck):
        raise ValueError("--n-kv-heads: --to megatron reads the KV heads from --hf-config's num_key_value_heads")
    if not is_torchtitan(ck):
        if hf_config is not None or seq_length is not None or lr_scheduler is not None or drop_norm_decay:
            raise UnsupportedCheckpoint(
                "--hf-config / --seq-length / --lr-scheduler / --drop-norm-decay describe a "
                "torchtitan run, "
                f"which saves no config; this is a {ck.format} checkpoint",
                path=Path(ck.path),
                hint="drop them",
            )
        return ck
    if hf_config is None:
        hf_cfg(ck)  # refuses, naming --hf-config
    cfg, where = read(ck, hf_config)
    heads, groups = titan_heads(cfg)
    return titan_view(ck, heads, groups, where, seq_length, lr_scheduler, drop_norm_decay)


# torchtitan 0.3.0's LR schedule (`LRSchedulersContainer.Config.build`: one LambdaLR factor for every group, from its
# job config, not saved) and its exact Megatron equivalent. With T total steps, W warm-up, D decay steps
# (round(T x decay_ratio), or T - W) and S = T + 1 - W - D stable steps, update n + 1 uses factor(n):
#   n < W: (n + 1) / W;   n < W + S: 1;   else mf + (1 - mf) g((n + 1 - W - S) / D)   (g: linear / sqrt / cosine)
# Megatron's OptimizerParamScheduler (core_v0.16), also at update n + 1 with num_steps = n iterations (x global batch),
# in WSD style with lr_decay_iters T, lr_wsd_decay_iters D: n <= T - D (= W + S - 1) gives 1, then g((n - T + D) / D),
# between each group's max_lr and min_lr = max_lr x mf: the same factors; with lr_warmup_iters W - 1 and
# lr_warmup_init = max_lr / W its warm-up is (n + 1) / W for the group whose max_lr is args.lr (one init for all).
_TITAN_SCHEDULE_KEYS = ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor", "training_steps", "total_steps")
WSD_STYLE = {"linear": "linear", "cosine": "cosine", "sqrt": "minus_sqrt"}


def parse_titan_schedule(spec: str, ck) -> dict[str, Any]:
    """`warmup_steps=2,decay_ratio=0.6,decay_type=linear,min_lr_factor=0,training_steps=5` (torchtitan's own
    `lr_scheduler` field names and `training.steps`) -> {T, W, D, S, type, mf}, by torchtitan 0.3.0's build rules."""
    got: dict[str, str] = {}
    for part in (p for p in spec.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in _TITAN_SCHEDULE_KEYS or not value.strip():
            refuse(
                f"--lr-scheduler {part!r}: use {', '.join(k + '=' for k in _TITAN_SCHEDULE_KEYS)} (torchtitan's "
                "lr_scheduler fields and training.steps)",
                ck,
            )
        got[key] = value.strip()
    if "training_steps" not in got and "total_steps" not in got:
        refuse("--lr-scheduler needs training_steps= (torchtitan's training.steps) or total_steps=", ck)
    try:
        t = int(got.get("total_steps") or got["training_steps"])
        w = min(int(got.get("warmup_steps", 200)), t)  # torchtitan's defaults where a field is left out
        ratio = None if got.get("decay_ratio", "none").lower() == "none" else float(got["decay_ratio"])
        mf = float(got.get("min_lr_factor", 0.0))
    except ValueError as e:
        refuse(f"--lr-scheduler {spec!r}: {e}", ck)
    kind = got.get("decay_type", "linear")
    if kind not in WSD_STYLE:
        refuse(f"--lr-scheduler decay_type={kind}: torchtitan's are linear, sqrt, cosine", ck)
    d = round(t * ratio) if ratio is not None else t - w
    d = min(d, t - w)
    if d < 1:
        refuse(
            f"--lr-scheduler {spec!r}: no decay steps (torchtitan's factor is then 1 after the warm-up): not mapped",
            ck,
            hint="omit --lr-scheduler: a constant schedule at each group's LR is written",
        )
    return {
        "T": t,
        "W": w,
        "D": d,
        "S": t + 1 - w - d,
        "type": kind,
        "mf": mf,
        "training_steps": int(got.get("training_steps") or t),
    }


def titan_factor(s: dict[str, Any], n: int) -> float:
    """torchtitan 0.3.0's LambdaLR factor for update n + 1 (see above)."""
    if n < s["W"]:
        return float((n + 1) / s["W"])
    if n < s["W"] + s["S"]:
        return 1.0
    progress = float(n + 1 - s["W"] - s["S"]) / s["D"]
    adj = {
        "linear": lambda: 1 - progress,
        "sqrt": lambda: 1 - math.sqrt(progress),
        "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[s["type"]]()
    return s["mf"] + (1 - s["mf"]) * adj


def titan_schedule(ck) -> dict[str, Any] | None:
    """The torchtitan schedule `--lr-scheduler` gave, checked against the checkpoint: each group's saved `lr` must be
    its `initial_lr` x the factor at the saved `last_epoch` (what torchtitan's LambdaLR set), or it is not this
    run's."""
    spec = ck.details.get("titan_schedule")
    if not spec:
        return None
    s = parse_titan_schedule(spec, ck)
    epoch = ck.counters.scheduler_last_epoch
    if epoch is None:
        refuse("the checkpoint holds no lr_scheduler.last_epoch: the schedule's position is unknown", ck)
    if ck.counters.global_step != epoch:  # Megatron's position is its iteration (train_state.step)
        refuse(
            f"train_state.step {ck.counters.global_step} and lr_scheduler.last_epoch {epoch} differ: Megatron "
            "places its schedule at its iteration, so the two must agree",
            ck,
            hint="convert without --lr-scheduler (a constant schedule at each group's saved LR)",
        )
    for g in L.param_groups(ck):
        base, lr = g.get("initial_lr"), g.get("lr")
        if not isinstance(base, (int, float)) or not isinstance(lr, (int, float)):
            refuse("a param group without initial_lr / lr: torchtitan's LambdaLR sets both", ck)
        want = base * titan_factor(s, epoch)
        if abs(want - lr) > 1e-9 * max(abs(lr), abs(want), 1e-30):
            refuse(
                f"--lr-scheduler {spec!r} gives lr {want:.6g} at last_epoch {epoch} for the group with initial_lr "
                f"{base:g}, but the checkpoint holds {lr:.6g}: not the schedule this run trained with",
                ck,
                hint="pass the run's own torchtitan lr_scheduler settings and training.steps",
            )
    mid_warmup = epoch < s["W"] - 1 and len({float(g["initial_lr"]) for g in L.param_groups(ck)}) > 1
    return {**s, "last_epoch": epoch, "mid_warmup": mid_warmup}


def titan_arch(ck, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The Llama the config.json describes (checked against the tensors by `source_view`), as Megatron's args;
    `shapes`: the view's {Megatron-core name: shape}."""
    cfg, _ = hf_cfg(ck)
    heads, groups = titan_heads(cfg)
    hidden = shapes["embedding.word_embeddings.weight"][1]
    theta, scaling = rope(cfg)
    seq = int(ck.details.get("seq_length") or cfg["max_position_embeddings"])
    return {
        "num_layers": sum(1 for k in shapes if k.endswith(".self_attention.linear_qkv.weight")),
        "hidden_size": hidden,
        "ffn_hidden_size": shapes["decoder.layers.0.mlp.linear_fc2.weight"][1],
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "group_query_attention": groups != heads,
        "kv_channels": int(cfg.get("head_dim") or hidden // heads),
        "padded_vocab_size": shapes["embedding.word_embeddings.weight"][0],
        "max_position_embeddings": int(cfg["max_position_embeddings"]),
        "seq_length": seq,
        "layernorm_epsilon": float(cfg["rms_norm_eps"]),
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "use_rope_scaling": scaling is not None,
        "rope_scaling_factor": float(scaling["factor"]) if scaling else 8.0,
        "untie_embeddings_and_output_weights": True,
        "add_position_embedding": False,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "bias_swiglu_fusion": False,
        "apply_rope_fusion": False,
    }
