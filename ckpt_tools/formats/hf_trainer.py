"""HF `transformers.Trainer` checkpoints: `output_dir/checkpoint-N/` folders, and the output_dir holding them.

A `checkpoint-N` folder holds `trainer_state.json` (the loop's `global_step`, `max_steps`, `log_history` with
the logged loss / learning_rate per step), `training_args.bin` (a pickled TrainingArguments: read inert, never
executed), `rng_state[_R].pth` (one per process), `config.json` and the model (`model.safetensors`, sharded
`model-0000x-of-0000y.safetensors` + index, or `pytorch_model.bin`), and where the optimizer and scheduler are:

    plain / DDP   `optimizer.pt` (torch optimizer state dict) + `scheduler.pt` (torch scheduler state dict)
    DeepSpeed     `global_stepN/` + `latest` inside the folder; the HF scheduler is handed to the engine and
                  saved in the model states' `lr_scheduler` (no optimizer.pt / scheduler.pt)
    FSDP          `pytorch_model_fsdp_0/` and `optimizer_0/` DCP folders + `scheduler.pt`

Given the output_dir, the newest `checkpoint-N` is opened (what `resume_from_checkpoint=True` picks), and the
others are listed in `details["checkpoints"]`.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, NotACheckpoint
from ..read.meta import meta_device
from ..read.tree import Checkpoint, Counters, GroupNode, Topology, ValueNode, Warning_, iter_tensors, to_node
from ..read.state import StateMap, StateSource
from . import _common as C
from . import dcp, deepspeed, deepspeed_moe, safetensors_file, torch_file
from ._protocol import UniversalSource
from .deepspeed import tag_state_sources

FORMAT = "hf_trainer"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
STATE_FILE = "trainer_state.json"


def _is_trainer_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).is_file()


def checkpoints(output_dir: Path) -> list[Path]:
    """The `checkpoint-N` folders of an output_dir, oldest first (by N)."""
    found = [d for d in output_dir.iterdir() if _CKPT_RE.match(d.name) and _is_trainer_checkpoint(d)]
    return sorted(found, key=lambda d: int(_CKPT_RE.match(d.name)[1]))


def sniff(path: Path) -> bool:
    if _is_trainer_checkpoint(path):
        return True
    return path.is_dir() and bool(checkpoints(path))


def _trainer_state(folder: Path) -> dict[str, Any]:
    p = folder / STATE_FILE
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"cannot read {STATE_FILE} ({e})", path=p, hint="the file is truncated or not JSON")
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{STATE_FILE} is not a JSON object", path=p)
    return doc


def last_logged(state: dict[str, Any]) -> dict[str, Any]:
    """The last logged training loss and learning rate in `log_history` (with the step they were logged at)."""
    out: dict[str, Any] = {}
    for entry in state.get("log_history") or []:
        if isinstance(entry, dict) and any(isinstance(entry.get(k), (int, float)) for k in ("loss", "learning_rate")):
            out = {"step": entry.get("step"), "loss": entry.get("loss"), "learning_rate": entry.get("learning_rate")}
    return out


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The Trainer `checkpoint-N` folder at `path`, or the newest one of an output_dir. Reads `trainer_state.json`,
    the weights through `safetensors_file.open` (headers only) or `torch_file.open` (`pytorch_model.bin`, inert),
    `optimizer.pt` / `scheduler.pt`, `rng_state*.pth` and `training_args.bin` inert, `config.json` /
    `generation_config.json` only parsed as JSON; a DeepSpeed tag folder inside (`global_stepN`) through
    `deepspeed_moe.open_any`, FSDP DCP folders through `dcp.open` (metadata only). Tensors stay lazy. Training
    state: `optimizer.pt` / `scheduler.pt` or the DeepSpeed tag folder's files, and trainer_state.json's
    `global_step` (`training_state`)."""
    folder = path
    details: dict[str, Any] = {}
    if not _is_trainer_checkpoint(path):
        found = checkpoints(path)
        if not found:
            raise NotACheckpoint("no checkpoint-N folder with trainer_state.json", path=path)
        folder = found[-1]
        details["output_dir"] = str(path)
        details["checkpoints"] = [d.name for d in reversed(found)]
        details["opened"] = folder.name
    state = _trainer_state(folder)
    cache = C.LoadCache(folder)
    tree: dict[str, Any] = {}
    files = [C.file_info(folder / STATE_FILE, path, "trainer_state")]
    warnings: list[Warning_] = []
    inner = _inner(folder, path, tree, files, warnings, details)
    weights = _weights(folder, path, tree, files)
    _torch_state(folder, path, cache, tree, files, warnings, inner)
    rng = _rng(folder, path, cache, tree, files, warnings, inner)
    _side_files(folder, path, tree, files, warnings)
    client = {k: v for k, v in state.items() if k != "log_history"}
    client["log_history"] = f"{len(state.get('log_history') or [])} entries"
    tree["trainer_state"] = GroupNode({k: to_node(v, STATE_FILE) for k, v in client.items()})
    counters, lrs, steps = _counters(tree, state, inner)
    logged = last_logged(state)
    if logged:
        details["last_logged"] = logged
    details["max_steps"] = state.get("max_steps")
    world = len(rng) or None
    details["world_size"] = world
    warnings += C.counter_warnings(counters, optimizer_steps_seen=steps)
    warnings += C.stray_file_warnings(folder, path) + cache.warnings()
    if inner is not None:
        totals = inner.parameter_count, inner.parameter_tensors, inner.dtypes
        if weights is not None and inner.details.get("weights") is None:
            totals = weights.parameter_count, weights.parameter_tensors, weights.dtypes
    elif weights is not None:
        totals = weights.parameter_count, weights.parameter_tensors, weights.dtypes
    else:
        totals = C.tensor_totals([t for _, t in iter_tensors(tree["model"])] if "model" in tree else [])
    topo = Topology(dp=world, tp=1, pp=1, zero_stage=inner.topology.zero_stage if inner is not None else None)
    order = ("model", "optimizer", "scheduler", "trainer_state", "counters", "rng", "training_args", "config")
    tree = C.in_order(tree, order)
    if details.get("checkpoints"):
        tree["checkpoints"] = ValueNode(details["checkpoints"])
    return C.checkpoint_of(FORMAT, path, topo, tree, counters, lrs, totals, files, warnings, details)


def _inner(folder: Path, path: Path, tree: dict, files: list, warnings: list, details: dict) -> Checkpoint | None:
    """The DeepSpeed tag folder or FSDP DCP folders inside the checkpoint folder, or None; their model, optimizer,
    scheduler, counters and config go into `tree`, their files into `files`."""
    inner = None
    if C.read_latest(folder) or any(folder.glob("global_step*/*model_states.pt")):
        inner = deepspeed_moe.open_any(folder)
        details["engine"] = f"deepspeed (tag {inner.details.get('tag')})"
    fsdp_model = sorted(d for d in folder.glob("pytorch_model_fsdp_*") if d.is_dir())
    if inner is None and fsdp_model:
        inner = dcp.open(fsdp_model[0])
        details["engine"] = f"fsdp ({fsdp_model[0].name})"
        for od in sorted(d for d in folder.glob("optimizer_*") if d.is_dir()):
            opt_ck = dcp.open(od)
            for key, node in opt_ck.tree.children.items():
                if key.startswith("optimizer"):
                    tree.setdefault(key, node)
            files += [replace(f, path=str(od.relative_to(path) / f.path)) for f in opt_ck.files]
    if inner is not None:
        for key in ("model", "optimizer", "scheduler", "counters", "config"):
            if key in inner.tree.children:
                tree.setdefault(key, inner.tree.children[key])
        files += [replace(f, path=str(Path(inner.path).relative_to(path) / f.path)) for f in inner.files]
        warnings += [w for w in inner.warnings if w.code not in ("stray-file", "step-mismatch")]
    return inner


def _weights(folder: Path, path: Path, tree: dict, files: list) -> Checkpoint | None:
    """The saved weights (`*.safetensors` or `pytorch_model.bin`) as a Checkpoint of their own, or None; their
    model goes into `tree`."""
    weights = None
    if any(folder.glob("*.safetensors")):
        weights = safetensors_file.open(folder)
        files += [replace(f, path=str((folder / f.path).relative_to(path))) for f in weights.files]
    elif (folder / "pytorch_model.bin").is_file():
        weights = torch_file.open(folder / "pytorch_model.bin")
        files.append(C.file_info(folder / "pytorch_model.bin", path, "model"))
    if weights is not None and "model" in weights.tree.children:
        tree["model"] = weights.tree.children["model"]
    return weights


def _torch_state(folder, path, cache, tree, files, warnings, inner) -> None:
    """`optimizer.pt` / `scheduler.pt` into `tree`; one saved without the other (plain/DDP) warned about."""
    for name, role in (("optimizer.pt", "optimizer"), ("scheduler.pt", "scheduler")):
        f = folder / name
        if f.is_file():
            _, optims, scheds, _rest = torch_file.split_training_dict({role: cache.load(f).obj})
            torch_file.state_nodes(optims, scheds, tree, name, [])
            files.append(C.file_info(f, path, role))
    plain = [n for n in ("optimizer.pt", "scheduler.pt") if (folder / n).is_file()]
    if len(plain) == 1 and inner is None:  # plain/DDP: both; DeepSpeed keeps the optimizer in its tag folder
        gone = "scheduler.pt" if plain[0] == "optimizer.pt" else "optimizer.pt"
        warnings.append(
            Warning_(
                "missing-state",
                f"{plain[0]} is saved but {gone} is not: the Trainer writes both; "
                f"a resume from this folder starts without {gone[:-3]} state",
                str((folder / gone).relative_to(path)),
            )
        )


def _rng(folder, path, cache, tree, files, warnings, inner) -> list[Path]:
    """The `rng_state*.pth` files (read inert into `tree`), the numbered ones missing for a world warned about."""
    rng = sorted(
        (p for p in folder.iterdir() if _RNG_RE.match(p.name)), key=lambda p: int(_RNG_RE.match(p.name)[1] or 0)
    )
    numbered = {int(_RNG_RE.match(p.name)[1]) for p in rng if _RNG_RE.match(p.name)[1] is not None}
    if numbered:
        # the Trainer writes rng_state.pth for one process and rng_state_{process_index}.pth for several: numbered
        # files are 0..world-1 (world >= 2; a DeepSpeed engine inside says how many)
        world = max(max(numbered) + 1, 2)
        if inner is not None and inner.topology and inner.topology.dp:
            world = max(world, inner.topology.dp * (inner.topology.tp or 1) * (inner.topology.pp or 1))
        gone = [f"rng_state_{i}.pth" for i in range(world) if i not in numbered]
        if gone:
            warnings.append(
                Warning_(
                    "missing-state",
                    f"{', '.join(gone)} missing ({world} processes saved RNG "
                    "states): those ranks resume with fresh random streams",
                    str((folder / gone[0]).relative_to(path)),
                )
            )
    if rng:
        tree["rng"] = GroupNode({p.stem: to_node(cache.load(p).obj, p.name) for p in rng})
        files += [C.file_info(p, path, "rng", {"rank": int(_RNG_RE.match(p.name)[1] or 0)}) for p in rng]
    return rng


def _side_files(folder: Path, path: Path, tree: dict, files: list, warnings: list) -> None:
    """`training_args.bin` (inert) into `tree`; `config.json` / `generation_config.json` listed and checked to
    parse, a missing config.json beside the weights warned about."""
    if (folder / "training_args.bin").is_file():
        # a pickled TrainingArguments: transformers classes, always; read inert without the unknown-global warning
        args_obj = C.LoadCache(folder).load(folder / "training_args.bin").obj
        tree["training_args"] = to_node(args_obj, "training_args.bin")
        files.append(C.file_info(folder / "training_args.bin", path, "other"))
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            files.append(C.file_info(folder / name, path, "config"))
            try:
                json.loads((folder / name).read_text())
            except (OSError, ValueError) as e:
                warnings.append(
                    Warning_(
                        "corrupt-file",
                        f"{name} is not valid JSON ({e}): from_pretrained and `ckpt export --hf` cannot use it",
                        str((folder / name).relative_to(path)),
                    )
                )
    if not (folder / "config.json").is_file() and "model" in tree:
        warnings.append(
            Warning_(
                "missing-state",
                "config.json is missing: the Trainer saves the model's config "
                "beside its weights; from_pretrained on this folder fails",
                str((folder / "config.json").relative_to(path)),
            )
        )


def _counters(tree: dict, state: dict, inner: Checkpoint | None) -> tuple[Counters, Any, list[int]]:
    """(counters, LRs, the Adam steps seen): from the tree's optimizer and scheduler, else the inner checkpoint's;
    the global step from trainer_state.json."""
    counters, lrs, steps = C.training_header(tree)
    opt_step = counters.optimizer_step
    if opt_step is None and inner is not None:
        opt_step = inner.counters.optimizer_step
    if lrs.param_groups == () and inner is not None:
        lrs = inner.lr
    sched_epoch, sched_count = counters.scheduler_last_epoch, counters.scheduler_step_count
    if sched_epoch is None and inner is not None:
        sched_epoch, sched_count = inner.counters.scheduler_last_epoch, inner.counters.scheduler_step_count
    gstep = state.get("global_step") if isinstance(state.get("global_step"), int) else None
    counters = Counters(
        global_step=gstep,
        optimizer_step=opt_step,
        scheduler_last_epoch=sched_epoch,
        scheduler_step_count=sched_count,
        skipped_steps=inner.counters.skipped_steps if inner is not None else None,
    )
    return counters, lrs, steps


def checkpoint_folder(ck: Checkpoint) -> Path:
    """The `checkpoint-N` folder a Checkpoint of this format reads (the newest one of an output_dir)."""
    p = Path(ck.path)
    return p / ck.details["opened"] if ck.details.get("opened") else p


def training_state(ck: Checkpoint):
    """optimizer.pt / scheduler.pt, the DeepSpeed tag folder's state files, or the FSDP optimizer DCP folder;
    trainer_state.json's `global_step` (the loop counter `resume_from_checkpoint` continues from)."""
    folder = checkpoint_folder(ck)
    # writes are planned against the output_dir, so backups and the journal land beside it, never among the
    # checkpoint-N folders that Trainer globs
    root = folder.parent if _CKPT_RE.match(folder.name) else folder
    rel = lambda p: str(p.relative_to(root))  # noqa: E731
    sources: list[StateSource] = []
    tag = C.read_latest(folder)
    if tag and (folder / tag).is_dir():
        sources += tag_state_sources(root, folder / tag)
    for od in sorted(d for d in folder.glob("optimizer_*") if d.is_dir() and (d / ".metadata").is_file()):
        sources.append(StateSource(od, rel(od), kind="dcp"))
    for name in ("optimizer.pt", "scheduler.pt"):
        if (folder / name).is_file():
            sources.append(StateSource(folder / name, rel(folder / name)))
    sources.append(StateSource(folder / STATE_FILE, rel(folder / STATE_FILE), kind="json"))
    return StateMap(root, tuple(sources))


def logical_layout(ck: Checkpoint) -> dict[str, Any]:
    """The model beyond its saved tensors (`ckpt_tools.view.logical`): under DeepSpeed, the tag folder's
    `shared_params` / frozen / buffer names; and the tied weights `config.json` implies (GPT-2's lm_head, left
    out of model.safetensors by `save_pretrained` when `tie_word_embeddings`)."""
    folder = checkpoint_folder(ck)
    out: dict[str, Any] = {}
    tag = C.read_latest(folder)
    if tag and (folder / tag).is_dir():
        out = deepspeed.model_layout(folder / tag)
    hf = hf_model_layout(folder)
    if hf:
        out.setdefault("order", [])
        out["order"] = out["order"] or hf["order"]
        out["tied"] = {**hf["tied"], **(out.get("tied") or {})}
        out["buffers"] = out.get("buffers") or hf["buffers"]
    return out


_HF_LAYOUTS: dict[tuple[str, float], dict[str, Any]] = {}


def hf_model_layout(folder: Path) -> dict[str, Any]:
    """{"order", "tied", "buffers"} of the transformers model `folder/config.json` describes, built on the meta
    device (no weights, no download, no remote code): the state-dict order, {alias: source} for parameters
    that are one tensor under two names, persistent buffers. {} without a config.json or transformers, or for
    a config transformers cannot build."""
    cfg = folder / "config.json"
    if not cfg.is_file():
        return {}
    try:
        doc = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("auto_map"):
        return {}  # a model with its own code: never run it
    key = (str(cfg.resolve()), cfg.stat().st_mtime)
    if key in _HF_LAYOUTS:
        return _HF_LAYOUTS[key]
    out: dict[str, Any] = {}
    try:
        import transformers  # lazy: transformers only to read a config's layout; an optional dependency

        config = transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        with meta_device():
            try:
                model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
            except ValueError:
                model = transformers.AutoModel.from_config(config, trust_remote_code=False)
        first: dict[int, str] = {}
        tied: dict[str, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            src = first.setdefault(id(p), n)
            if src != n:
                tied[n] = src
        sd = model.state_dict()
        param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        out = {"order": list(sd), "tied": tied, "buffers": [n for n in sd if n not in param_names]}
    except Exception:  # a config this transformers cannot build: nothing more than the files say
        out = {}
    _HF_LAYOUTS[key] = out
    return out


def universal_source(path: Path, tp_patterns: tuple[str, ...] = ()) -> UniversalSource:
    """For `ckpt to-universal`: the DeepSpeed tag folder this checkpoint holds (a refusal naming the fix where it
    holds none)."""
    return deepspeed_moe.zero_tag_source(path)
