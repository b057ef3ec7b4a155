"""torchtune output folders (measured with torchtune 0.6.1's `full_finetune_single_device` and
`lora_finetune_single_device` recipes, `FullModelHFCheckpointer`).

An intermediate save is TWO places in the recipe's `output_dir`:
- `epoch_N/`: the weights in Hugging Face names (`model-0000i-of-0000n.safetensors` + index + `config.json`),
  or for LoRA only the adapter (`adapter_model.safetensors`, PEFT names, + `adapter_config.json`);
- `recipe_state/recipe_state.pt`: `seed`, `epochs_run`, `total_epochs`, `max_steps_per_epoch`, the data
  loader's state and `optimizer` (a torch optimizer state dict keyed by integer ids in the order of the
  trained parameters). Written with every save but the last (the final epoch is saved model-only), so it goes
  with `epoch_{epochs_run - 1}`.

No global step and no scheduler state are saved: on resume the recipe rebuilds its scheduler from the optimizer's
`initial_lr` at step `epochs_run x steps per epoch`, so `initial_lr` drives the LR (`ops.lr` says so).

The optimizer ids are mapped to the epoch folder's names in torchtune's own parameter order for its Llama-family
decoder (`tok_embeddings`, per layer `attn.q/k/v/output_proj`, `mlp.w1/w2/w3`, `sa_norm`, `mlp_norm`, then
`norm`, `output`), confirmed by the shapes of each id's Adam state (`torch_file.match_param_ids`); weights this
order does not cover keep their ids (a warning says so). LoRA: the optimizer lists every parameter of the model,
state only for the adapter's; those ids, in order, are the adapter's parameters in `adapter_model.pt`'s order
(torchtune's names), shown under the PEFT names of `adapter_model.safetensors`, confirmed by shapes. A later
`epoch_N` (the final, model-only save) is another save (`other_saves`), not an unread part of this one.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import MissingFile
from ..read.state import StateMap, StateSource
from ..read.tree import Checkpoint, GroupNode, Topology, Warning_, iter_tensors, to_node
from . import _common as C
from . import safetensors_file, torch_file

FORMAT = "torchtune"
RECIPE_STATE = Path("recipe_state") / "recipe_state.pt"
_EPOCH_RE = re.compile(r"^epoch_(\d+)$")

#: Hugging Face Llama name -> its place in torchtune's parameter order ((layer, position) ; layer -1 first,
#: 10**9 last) -- the order torchtune's llama builders register the modules in
_LAYER_ORDER = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.down_proj.weight",
    "mlp.up_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP = {"model.embed_tokens.weight": (-1, 0), "model.norm.weight": (10**9, 0), "lm_head.weight": (10**9, 1)}


def _epochs(folder: Path) -> list[tuple[int, Path]]:
    out = []
    for d in folder.iterdir() if folder.is_dir() else ():
        m = _EPOCH_RE.match(d.name)
        if m and d.is_dir():
            out.append((int(m[1]), d))
    return sorted(out)


def sniff(path: Path) -> bool:
    """A recipe output folder: `recipe_state/recipe_state.pt` beside `epoch_N/` folders."""
    return path.is_dir() and (path / RECIPE_STATE).is_file() and bool(_epochs(path))


def torchtune_order(names: list[str]) -> list[str] | None:
    """The Hugging Face `names` in torchtune's parameter order for its Llama-family decoder, or None when a
    name is not one of that family's."""
    keyed = []
    for n in names:
        if n in _TOP:
            keyed.append((_TOP[n], n))
            continue
        m = _LAYER_RE.match(n)
        if not m or m[2] not in _LAYER_ORDER:
            return None
        keyed.append(((int(m[1]), _LAYER_ORDER.index(m[2])), n))
    return [n for _, n in sorted(keyed)]


_LORA_RE = re.compile(r"^layers\.(\d+)\.(attn|mlp)\.(\w+)\.lora_(a|b)\.weight$")
_PEFT_MODULE = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "output_proj": "self_attn.o_proj",
    "w1": "mlp.gate_proj",
    "w2": "mlp.down_proj",
    "w3": "mlp.up_proj",
}


def peft_name(tune: str) -> str | None:
    """torchtune's LoRA parameter name -> the PEFT name its checkpointer writes to adapter_model.safetensors."""
    if tune.startswith("output.lora_"):
        return f"base_model.model.lm_head.lora_{tune[12].upper()}.weight"
    m = _LORA_RE.match(tune)
    if not m or m[3] not in _PEFT_MODULE:
        return None
    return f"base_model.model.model.layers.{m[1]}.{_PEFT_MODULE[m[3]]}.lora_{m[4].upper()}.weight"


def _lora_ids(osd: dict, tune: Any, shapes: dict[str, tuple]) -> dict[Any, str]:
    """Optimizer id -> adapter name: the ids that have state (the trainable ones), in increasing order, are the
    adapter's parameters in torchtune's module order (adapter_model.pt's order); kept only when every count,
    name and shape agrees."""
    state = osd.get("state") if isinstance(osd.get("state"), dict) else {}
    if not isinstance(tune, dict):
        return {}
    ids = sorted(state, key=lambda i: (not isinstance(i, int), i))
    names = [peft_name(str(k)) for k in tune]
    if len(ids) != len(names) or None in names or set(names) != set(shapes):
        return {}
    out = {}
    for i, name, t in zip(ids, names, tune.values()):
        st = state[i] if isinstance(state[i], dict) else {}
        ref = next((v for v in st.values() if getattr(v, "numel", 0) > 1), None)
        if ref is None or tuple(ref.shape) != shapes[name] or tuple(getattr(t, "shape", ())) != shapes[name]:
            return {}
        out[i] = name
    return out


def _rename_state(node: GroupNode, names: dict[Any, str]) -> GroupNode:
    st = node.children.get("state")
    if not isinstance(st, GroupNode):
        return node
    renamed = GroupNode({names.get(_key(k), k): v for k, v in st.children.items()})
    return GroupNode({**node.children, "state": renamed})


def _key(k: str) -> Any:
    return int(k) if k.isdigit() else k


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The recipe `output_dir` at `path`. Reads `recipe_state/recipe_state.pt` inert (optimizer, epochs_run,
    seed, ...), the weights of the epoch folder saved with it (`epoch_{epochs_run - 1}`: its `*.safetensors`
    headers through `safetensors_file.open`, or `adapter_model.safetensors` for LoRA, with `adapter_model.pt`
    read inert for the optimizer's id order); later epoch folders (weights-only final saves) are only named.
    Tensors stay lazy. Training state: `recipe_state/recipe_state.pt` (`training_state`)."""
    folder = path
    cache = C.LoadCache(folder)
    loaded = cache.load(folder / RECIPE_STATE)
    state = loaded.obj if isinstance(loaded.obj, dict) else {}
    rel = str(RECIPE_STATE)
    epochs_run = _as_int(state.get("epochs_run"))
    warnings: list[Warning_] = []
    with_state, details = _epoch_with_state(folder, epochs_run, rel)
    files = []
    adapter = with_state / "adapter_model.safetensors"
    if adapter.is_file():
        weights = safetensors_file.open(adapter)
        details["adapter"] = f"{with_state.name}/adapter_model.safetensors (LoRA: the base model is not saved)"
    else:
        weights = safetensors_file.open(with_state)
    files += [replace(f, path=str(Path(with_state.name) / f.path)) for f in weights.files]
    files.append(C.file_info(folder / RECIPE_STATE, folder, "optimizer"))
    model = weights.tree.children.get("model") if isinstance(weights.tree, GroupNode) else None
    model = model if isinstance(model, GroupNode) else GroupNode({})
    tree: dict[str, Any] = {"model": model}
    _optimizer(state, model, with_state, adapter, cache, folder, rel, tree, files, warnings)
    client = {k: v for k, v in state.items() if k != "optimizer"}
    tree["client_state"] = to_node(client, rel)
    counters, lrs, steps = C.training_header(tree)
    steps_per_epoch = _as_int(state.get("max_steps_per_epoch"))
    if epochs_run is not None and steps_per_epoch:
        derived = epochs_run * steps_per_epoch
        details["global_step"] = (
            f"epochs_run {epochs_run} x max_steps_per_epoch {steps_per_epoch} = {derived}"
            " (what the recipe resumes at when every epoch ran max_steps_per_epoch steps)"
        )
        if set(steps) <= {derived}:
            counters = replace(counters, global_step=derived)
        else:
            warnings.append(
                Warning_(
                    "step-mismatch",
                    f"epochs_run x max_steps_per_epoch = {derived}, but Adam's "
                    f"step is {sorted(set(steps))}: an epoch ran fewer steps (a short dataset)",
                    rel,
                )
            )
    details.update(
        {
            k: state[k]
            for k in ("epochs_run", "total_epochs", "max_steps_per_epoch", "seed")
            if isinstance(state.get(k), int)
        }
    )
    details["resume_unsupported"] = _recipe_resume(folder, with_state, adapter.is_file())
    warnings += C.counter_warnings(counters, optimizer_steps_seen=steps) + cache.warnings()
    params = [t for _, t in iter_tensors(model)]
    return Checkpoint(
        format=FORMAT,
        path=str(folder),
        topology=Topology(dp=1, tp=1, pp=1, zero_stage=None),
        tree=GroupNode(tree),
        counters=counters,
        lr=lrs,
        parameter_count=sum(t.numel for t in params),
        parameter_tensors=len(params),
        files=tuple(files),
        warnings=tuple(warnings),
        dtypes=tuple(sorted({t.dtype for t in params})),
        details=details,
    )


def _epoch_with_state(folder: Path, epochs_run: int | None, rel: str) -> tuple[Path, dict[str, Any]]:
    """(the epoch folder whose weights were saved with the recipe state: epoch_{epochs_run - 1}, the details so
    far: the epochs present, the later weights-only saves); refused when that folder is missing."""
    epochs = _epochs(folder)
    details: dict[str, Any] = {
        "recipe_state": rel,
        "epochs": [d.name for _, d in epochs],
        "scheduler_rebuilt": "not saved: the recipe rebuilds its scheduler from each param "
        "group's initial_lr at the resumed step",
    }
    # the weights saved with the recipe state: epoch_{epochs_run - 1}
    with_state = next((d for n, d in epochs if epochs_run is not None and n == epochs_run - 1), None)
    if with_state is None:
        want = f"epoch_{epochs_run - 1}" if epochs_run else "epoch_N"
        raise MissingFile(
            f"{rel} records epochs_run={epochs_run}, but {want}/ (the weights saved with it) is not here",
            path=folder / want,
            hint="restore that epoch folder: a resume reads it",
        )
    details["opened"] = with_state.name  # the epoch folder whose weights go with the recipe state (config.json too)
    later = [d.name for n, d in epochs if epochs_run is not None and n >= epochs_run]
    if later:
        details["model_only_saves"] = later  # the final save: weights only, no recipe state
        details["other_saves"] = later  # not part of this checkpoint (accounting leaves them to their own open)
    return with_state, details


def _optimizer(state, model, with_state, adapter, cache, folder, rel, tree, files, warnings) -> None:
    """The recipe state's optimizer into `tree`, its ids named in torchtune's parameter order (full fine-tune) or
    by `adapter_model.pt`'s order (LoRA); ids left unnamed warned about."""
    shapes = {k: tuple(t.shape) for k, t in iter_tensors(model)}
    osd = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else None
    lora_names: dict[Any, str] = {}
    if adapter.is_file() and (with_state / "adapter_model.pt").is_file():
        # torchtune writes the adapter twice: adapter_model.pt (its own names, module order) and the PEFT-named
        # safetensors; the .pt gives the order the optimizer numbered the trainable parameters in
        pt = with_state / "adapter_model.pt"
        tune = cache.load(pt).obj
        files.append(C.file_info(pt, folder, "model (copy in torchtune's names)"))
        if isinstance(osd, dict):
            lora_names = _lora_ids(osd, tune, shapes)
    if osd is not None:
        order = torchtune_order(list(shapes)) if not adapter.is_file() else None
        node = torch_file.optimizer_tree(osd, order or [], rel, {n: shapes[n] for n in order} if order else None)
        if lora_names:
            node = _rename_state(node, lora_names)
        tree["optimizer"] = node
        st = node.children.get("state")
        if isinstance(st, GroupNode) and any(k.isdigit() for k in st.children) and not lora_names:
            why = (
                "LoRA: the optimizer holds every parameter of the model, the folder only the adapter"
                if adapter.is_file()
                else "the weights are not all in torchtune's Llama-family order"
            )
            warnings.append(
                Warning_(
                    "optimizer-ids-unnamed",
                    f"{rel}: optimizer state keyed by ids that could not be matched to parameter names ({why})",
                    rel,
                )
            )


def _recipe_resume(folder: Path, epoch: Path, lora: bool) -> str:
    """What `ckpt resume` says instead of replaying a torchtune checkpoint: the recipe itself resumes it (it rebuilds
    the model, the scheduler and the data from its config), with torchtune 0.6.1's overrides for this folder (the
    ones the real-recipe resume tests use)."""
    config = folder / "torchtune_config.yaml"
    cfg = str(config) if config.is_file() else "YOUR_CONFIG.yaml"
    if lora:
        weights = (
            f"checkpointer.adapter_checkpoint={epoch.name}/adapter_model.pt (the base model stays at the "
            "config's checkpointer.checkpoint_dir: the original pretrained folder)"
        )
    else:
        files = ",".join(f"{epoch.name}/{p.name}" for p in sorted(epoch.glob("model-*.safetensors")))
        weights = f"checkpointer.checkpoint_dir={epoch} checkpointer.checkpoint_files=[{files}]"
    return (
        "torchtune rebuilds the model, the scheduler and the data loader from its recipe config; resume it with "
        f"the recipe: tune run RECIPE --config {cfg} resume_from_checkpoint=True output_dir={folder} "
        f"checkpointer.output_dir={folder} {weights} checkpointer.recipe_checkpoint={RECIPE_STATE} "
        "(the resumed run saves its later epochs into output_dir)"
    )


def training_state(ck: Checkpoint):
    """`recipe_state/recipe_state.pt`: the optimizer (its param groups' `initial_lr` drive the LR on resume)."""
    root = Path(ck.path)
    return StateMap(root, (StateSource(root / RECIPE_STATE, str(RECIPE_STATE)),))
