"""`ckpt export`: consolidated model weights as safetensors, from any format the tree reads (DeepSpeed ZeRO 1/2/3,
the Megatron-DeepSpeed pipeline with TP merged, universal, DCP, FSDP1 sharded, Accelerate, HF Trainer, torch and
safetensors files), through the logical view `ckpt_tools.view.logical`.

Nothing is lost: tied parameters come under every name (as DeepSpeed's zero_to_fp32 writes them; `tied="dedupe"`
writes one), frozen parameters at every ZeRO stage (`include_frozen=False` leaves them out), buffers too.
Weights are the fp32 master where the format keeps one (zero_to_fp32's values) or the saved module weights.

The files are written as a stream: each file's safetensors header is computed from the logical shapes and
dtypes before any tensor is read, then each tensor is appended: copied file to file by the kernel where its
bytes lie in the source as they are to be written (copy_file_range from its ZeRO pieces: the fp32 master of a
ZeRO checkpoint, with no torch import), else read (one at a time: its ZeRO pieces / TP shards / DCP chunks),
merged and converted. Memory stays at one tensor at most, whatever the model size. Sharded output (`--max-shard-size`)
follows Hugging Face: `<stem>-00001-of-0000N.safetensors` + `<stem>.safetensors.index.json`; `hf=True` writes a
folder `from_pretrained` loads (`model[-0000i-of-0000N].safetensors`, the index, config.json and
generation_config.json copied when the checkpoint has them, tied aliases left out as `save_pretrained` does).
Everything is written under `.ckpt-staging-` names (a staging folder for `hf`) and renamed when complete;
`verify` re-reads the output and compares it tensor for tensor with the source.

A torchrun job (`execute(distributed=True)`; `_execute_job` on `write/shares.run_job`, to-universal's and convert's
job) writes the same bytes: every file's layout (header, each tensor's offset) follows from the plan alone, so each
rank writes a share of the tensors, balanced by bytes, at their offsets into the staging files (`.ckpt-staging-OUT-job`
beside OUT), each tensor journaled with its byte span's CRC-32; rank 0 writes the headers, the index and the config
files, and puts the files in place. An interrupted job is resumed by the same command (any number of processes).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import CkptError, UnsupportedCheckpoint
from ..formats import detect
from ..read import gate
from ..read.pickle_reader import FdCache
from ..read.pickle_records import DTYPE_SIZE
from ..read.tensor_read import source_ranges
from ..read.tp_layout import SOURCE_PRESET
from ..read.tree import Checkpoint, TensorNode
from ..view import logical as L
from ..view.accounting import guard, unread_files
from ..view.logical import LogicalTensor
from ..view.logical import node_to_display
from ..write import io, shares
from ..write.io import copy_range
from ..write.torch_zip import start_writeback
from ..view.torchtitan import is_torchtitan_llama
from . import hf_map

_ST_DTYPE = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_DTYPE_ARG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", None: None}
HF_CONFIG_FILES = ("config.json", "generation_config.json")


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 (Hugging Face's convention)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"{text!r} is not a size (use e.g. 5GB, 500MB, 2GiB)")
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** " KMGT".index(m[2].upper() or " "))


@dataclass(frozen=True)
class ExportTensor:
    name: str
    source: LogicalTensor = field(repr=False)
    shape: tuple[int, ...]
    dtype: str  # output dtype
    #: applied to the tensor read (same shape): `--hf` from torchtitan names, the q/k RoPE permutation
    transform: Callable[[Any], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZE[self.dtype]

    def read(self):
        x = self.source.read(self.dtype)
        return self.transform(x) if self.transform is not None else x

    @property
    def node(self):
        return self.source.node


@dataclass(frozen=True)
class ExportPlan:
    """The files `execute` writes: `shards[i]` is the list of tensors of file `files[i]`. With `hf`, `out` is a
    folder (built under `staging` and renamed) and `copies` the config files copied into it."""

    source: Path
    out: Path
    weights_from: str
    files: tuple[Path, ...]
    shards: tuple[tuple[ExportTensor, ...], ...]
    index: Path | None
    hf: bool = False
    copies: tuple[Path, ...] = ()
    skipped: dict[str, list[str]] = field(default_factory=dict)  # why -> names left out (tied / frozen / filtered)
    source_format: str = ""
    #: with `hf`: the config.json written from the checkpoint itself (a Megatron GPT's `args`), when not copied
    config: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.shards for t in s)

    @property
    def tensors(self) -> tuple[ExportTensor, ...]:
        return tuple(t for s in self.shards for t in s)

    def to_json(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for t in self.tensors:
            kinds[t.source.kind] = kinds.get(t.source.kind, 0) + 1
        return {
            "source": str(self.source),
            "format": self.source_format,
            "out": str(self.out),
            "hf": self.hf,
            "weights_from": self.weights_from,
            "bytes": self.nbytes,
            "tensors": len(self.tensors),
            "kinds": kinds,
            "index": str(self.index) if self.index else None,
            "files": [
                {"path": str(f), "tensors": len(s), "bytes": sum(t.nbytes for t in s)}
                for f, s in zip(self.files, self.shards)
            ],
            "copies": [str(c) for c in self.copies],
            "config": self.config,
            "left_out": {k: v for k, v in self.skipped.items() if v},
        }


def _open(src: Path, patterns: Sequence[str]) -> Checkpoint:
    """The source opened by its format's reader, given the user's TP patterns where that reader takes them (its
    `open` has a `tp_patterns` parameter), so that the tree's merge rules are the ones --pattern asks for."""
    mod = detect(src)
    if "tp_patterns" in inspect.signature(mod.open).parameters:
        return mod.open(src, tp_patterns=tuple(patterns))
    return mod.open(src)


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def plan_export(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: int | None = None,
    source_weights: str = "fp32",
    tp_layout: str | None = None,
    patterns: Sequence[str] = (),
    tied: str = "all",
    include_frozen: bool = True,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    hf: bool = False,
    model: int = 0,
    allow_unread: bool = False,
    hf_config: str | os.PathLike | None = None,
    trust_pickles: bool = False,
) -> ExportPlan:
    """Which tensors go into which file. `source_weights`: "fp32" (the optimizer's fp32 master, the same
    values zero_to_fp32 writes, where the format has one) or "module" (the saved module weights, e.g. bf16).
    `hf`: `out` is a new folder for `from_pretrained` (tied aliases left out unless tied="all" is asked
    for explicitly by passing tied="keep"); `hf_config`: the model's Hugging Face config.json (or its folder) to
    copy instead of the checkpoint's, required for a torchtitan Llama (its names and q/k layout are mapped to
    Hugging Face's with the head counts it gives: `ops.hf_map`)."""
    if source_weights not in ("fp32", "module"):
        raise ValueError(f"--source {source_weights!r}: use fp32 or module")
    if dtype not in _DTYPE_ARG:
        raise ValueError(f"--dtype {dtype!r}: use fp32, bf16 or fp16")
    src = Path(source)
    out = Path(out)
    ck = _open_checked(src, out, hf, tp_layout, patterns, allow_unread, trust_pickles)
    if tied == "keep":
        tied_mode = "all"
    else:
        tied_mode = "dedupe" if hf else tied
    tensors, skipped = _tensors(ck, src, source_weights, include_frozen, tied_mode, include, exclude, model)
    want = _DTYPE_ARG[dtype]
    items = [
        ExportTensor(
            t.name,
            t,
            tuple(t.shape),
            want if want and t.dtype in ("float32", "bfloat16", "float16", "float64") else t.dtype,
        )
        for t in tensors
    ]
    if hf_config is not None and not hf:
        raise ValueError("--hf-config applies to --hf")
    cfg_file = _hf_config_file(hf_config) if hf_config is not None else None
    hf_cfg = None
    if hf:
        items, hf_cfg = _hf_names(items, cfg_file, src, ck)
    groups = _shard_groups(items, max_shard_size)
    files, index, copies = _output_files(ck, out, hf, len(groups), cfg_file, hf_cfg is not None)
    weights_from = "fp32 master where saved" if source_weights == "fp32" else "module weights"
    return ExportPlan(
        src, out, weights_from, files, tuple(tuple(g) for g in groups), index, hf, copies, skipped, ck.format, hf_cfg
    )


def _open_checked(
    src: Path,
    out: Path,
    hf: bool,
    tp_layout: str | None,
    patterns: Sequence[str],
    allow_unread: bool,
    trust_pickles: bool,
) -> Checkpoint:
    """The source, opened whole (`accounting.guard`); refused when the output would be inside it (or, `hf`, hold
    it), and when its TP merge rules would be a guess from parameter names alone."""
    ck = guard(_open(src, patterns), src, "export", allow_unread=allow_unread, trust_pickles=trust_pickles)
    root = Path(ck.path)
    if root.is_dir() and (_inside(out, root) or _inside(out.parent, root) and not hf):
        raise CkptError(
            "the output would be inside the checkpoint folder",
            path=out,
            hint=f"write it outside {root}: a file inside a checkpoint folder is a stray file to loaders",
        )
    if hf and _inside(root, out):
        raise CkptError("the output folder would contain the checkpoint", path=out, hint="choose a new folder")
    # the tree's TP merge rules come from the Megatron naming preset alone (`read.tp_layout`'s source, which the
    # format names in details["tp_layout"]): not recorded in the checkpoint, not asked for
    guessed = ck.details.get("tp_layout") == SOURCE_PRESET
    if (ck.topology.tp or 1) > 1 and guessed and tp_layout != "megatron" and not patterns:
        raise UnsupportedCheckpoint(
            "tensor-parallel checkpoint without universal_checkpoint_info",
            path=src,
            hint="pass --tp-layout megatron or --pattern REGEX=MERGE",
        )
    return ck


def _tensors(
    ck: Checkpoint,
    src: Path,
    source_weights: str,
    include_frozen: bool,
    tied_mode: str,
    include: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    model: int,
) -> tuple[list[LogicalTensor], dict[str, list[str]]]:
    """(the logical tensors to export, the names left out by kind: tied, frozen, filtered, unread files); refused
    when a tensor has no TP merge rule or a dtype safetensors does not hold, or none is left."""
    try:
        tensors = L.model_tensors(
            ck,
            weights=source_weights,
            include_frozen=include_frozen,
            tied=tied_mode,
            include=include,
            exclude=exclude,
            model=model,
        )
    except ValueError as e:
        if str(e).startswith("model="):
            raise CkptError(
                f"--model {model}: {str(e).split(': ', 1)[1]}", path=src, hint="pick one of those with --model N"
            ) from None
        raise CkptError(str(e), hint="--include / --exclude take Python regular expressions") from None
    unfiltered = (
        tied_mode == "all"
        and include_frozen
        and all(f is None or not isinstance(f, str) and len(f) == 0 for f in (include, exclude))
    )  # the same call twice
    everything = tensors if unfiltered else L.model_tensors(ck, weights=source_weights, model=model)
    kept = {t.name for t in tensors}
    skipped = {"tied": [], "frozen": [], "filtered": [], "unread files (--allow-unread)": unread_files(ck)}
    for t in everything:
        if t.name in kept:
            continue
        if t.kind == "tied" and tied_mode == "dedupe":
            skipped["tied"].append(t.name)
        elif t.kind == "frozen" and not include_frozen:
            skipped["frozen"].append(t.name)
        else:
            skipped["filtered"].append(t.name)
    for t in tensors:
        n = t.node
        if getattr(n, "shards", ()) and n.merge in (None, "unknown"):
            raise UnsupportedCheckpoint(
                f"no TP merge rule for {t.name}", path=src, hint="pass --pattern REGEX=MERGE for it"
            )
        if t.dtype not in _ST_DTYPE:
            raise UnsupportedCheckpoint(
                f"{t.name} has dtype {t.dtype}, which safetensors export does not write",
                path=src,
                hint="leave it out with --exclude",
            )
    if not tensors:
        raise UnsupportedCheckpoint(
            "no model tensors to export" + (" (every tensor was filtered out)" if everything else ""),
            path=src,
            hint="check --include / --exclude" if everything else "this checkpoint holds no model weights",
        )
    return tensors, skipped


def _shard_groups(items: list[ExportTensor], max_shard_size: int | None) -> list[list[ExportTensor]]:
    """The tensors of each output file, in order: a new file once the next tensor would pass `max_shard_size`."""
    groups: list[list[ExportTensor]] = [[]]
    size = 0
    for t in items:
        if max_shard_size and groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def _output_files(
    ck: Checkpoint, out: Path, hf: bool, n_files: int, cfg_file: Path | None, own_config: bool
) -> tuple[tuple[Path, ...], Path | None, tuple[Path, ...]]:
    """(the safetensors files, the index when there are several, the config files copied beside them with `hf`;
    `own_config`: config.json is written from the checkpoint, not copied)."""
    copies: tuple[Path, ...] = ()
    if hf:
        folder = out
        stem = "model"
        single = folder / "model.safetensors"
        cfg_dir = cfg_file.parent if cfg_file is not None else _config_dir(ck)
        copies = tuple(cfg_dir / n for n in HF_CONFIG_FILES if (cfg_dir / n).is_file())
    else:
        folder = out.parent
        stem = out.name[: -len(".safetensors")] if out.name.endswith(".safetensors") else out.name
        single = out
    if n_files == 1:
        files, index = (single,), None
    else:
        files = tuple(folder / f"{stem}-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files))
        index = folder / f"{stem}.safetensors.index.json"
    if own_config:
        copies = tuple(c for c in copies if c.name != "config.json")
    return files, index, copies


def _hf_config_file(hf_config: str | os.PathLike) -> Path:
    """The config.json `--hf-config` names (the file, or the folder holding it)."""
    given = Path(hf_config)
    path = given / "config.json" if given.is_dir() else given
    if path.name != "config.json" or not path.is_file():
        raise CkptError(
            "--hf-config: no config.json there",
            path=given,
            hint="pass the model's Hugging Face config.json (named config.json) or its folder",
        )
    return path


def _hf_names(
    items: list[ExportTensor], cfg_file: Path | None, src: Path, ck: Any
) -> tuple[list[ExportTensor], dict[str, Any] | None]:
    """`items` under Hugging Face names where the checkpoint's are another framework's (`ops.hf_map`), and the
    config.json to write when the checkpoint itself describes the model: a torchtitan Llama's names and q/k layout
    mapped with the head counts of the config.json given; a Megatron GPT shaped like GPT-2 mapped, and its
    GPT2Config written, from the checkpoint's own `args`."""
    names = [t.name for t in items]
    if hf_map.is_megatron_gpt(names):
        args = node_to_display(ck.tree.children["args"]) if "args" in ck.tree.children else None
        if not isinstance(args, dict):
            raise CkptError(
                "a Megatron GPT checkpoint without `args`: the Hugging Face config comes from them",
                path=src,
                hint="export without --hf",
            )
        if cfg_file is not None:
            raise CkptError(
                "a Megatron GPT: config.json is written from the checkpoint's own args",
                path=cfg_file,
                hint="drop --hf-config",
            )
        config = hf_map.megatron_hf_config(args, str(src))
        mapping = hf_map.megatron_to_hf({t.name: t.shape for t in items}, config, str(src))
        return [
            replace(t, name=hf, transform=fn, shape=shape) for t in items for hf, fn, shape in mapping[t.name]
        ], config
    if not is_torchtitan_llama(names):
        return items, None
    if cfg_file is None:
        raise CkptError(
            "a torchtitan Llama checkpoint: --hf maps its names and q/k layout to Hugging Face's with the "
            "head counts, which the checkpoint does not hold",
            path=src,
            hint="add --hf-config CONFIG.json (the model's Hugging Face config: num_attention_heads, "
            "num_key_value_heads, ...)",
        )
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"--hf-config: cannot read it ({e})", path=cfg_file, hint="pass a JSON config.json") from None
    mapping = hf_map.torchtitan_llama_to_hf({t.name: t.shape for t in items}, config, str(cfg_file))
    return [replace(t, name=mapping[t.name][0], transform=mapping[t.name][1]) for t in items], None


def _config_dir(ck) -> Path:
    """Where a checkpoint keeps config.json: the folder its reader opened inside the path given (an HF Trainer
    output_dir's newest checkpoint-N, a torchtune output folder's epoch_N)."""
    p = Path(ck.path)
    opened = ck.details.get("opened") if isinstance(ck.details, dict) or hasattr(ck.details, "get") else None
    if opened and (p / str(opened)).is_dir():
        return p / str(opened)
    return p if p.is_dir() else p.parent


_METADATA = {"format": "pt"}  # the header's __metadata__, as safetensors.torch.save_file writes it


def _header(tensors: Sequence[ExportTensor], metadata: dict[str, str]) -> bytes:
    head: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for t in tensors:
        head[t.name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_file(path: Path, tensors: Sequence[ExportTensor], progress: Callable[[int], None] | None) -> None:
    """Stream `tensors` into `path` (which the caller has made a staging name). A tensor stored as it is written
    (same dtype, its ZeRO pieces / file ranges in order: a fp32 master of any ZeRO stage, a torch or
    safetensors file's tensor) is copied file to file by the kernel (`io.copy_range`); the others are read,
    merged and converted in memory, one at a time."""
    fds = FdCache()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        at = _pwrite(fd, memoryview(_header(tensors, _METADATA)), 0)
        flushed = at
        for t in tensors:
            if at - flushed >= _WRITEBACK_EVERY:  # the disk writes while the next tensors are copied
                start_writeback(fd)
                flushed = at
            at = _write_tensor(fd, t, at, fds, path)
            if progress:
                progress(t.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
        fds.close()


def _write_tensor(fd: int, t: ExportTensor, at: int, fds, path: Path) -> int:
    """`t`'s output bytes into `fd` from offset `at` (copied by the kernel where they lie in the source as they are
    written, else read, merged and converted); returns the offset after them."""
    ranges = _ranges(t, fds)
    if ranges is not None:
        for r in ranges:
            copy_range(r.fd, fd, r.offset, at, r.length)
            at += r.length
        return at
    x = t.read()
    if tuple(x.shape) != tuple(t.shape):
        raise CkptError(
            f"{t.name}: read {tuple(x.shape)}, planned {tuple(t.shape)}",
            path=path,
            hint="the checkpoint changed while exporting; run it again",
        )
    if x.numel():
        at = _pwrite(fd, memoryview(x.contiguous().view(-1).view(_u8()).numpy()), at)
    return at


_WRITEBACK_EVERY = 64 << 20


def _ranges(t: ExportTensor, fds):
    """The file ranges holding `t`'s output bytes as they are (`tensor_read.source_ranges`), or None when it
    must be read: another dtype, TP shards to merge, vocabulary padding to strip."""
    node = t.node
    if (
        t.transform is not None
        or not isinstance(node, TensorNode)
        or node.dtype != t.dtype
        or node.numel != math.prod(t.shape)
    ):
        return None
    ranges = source_ranges(node, fds)
    if ranges is None or sum(r.length for r in ranges) != t.nbytes:
        return None
    return ranges


def _pwrite(fd: int, view: memoryview, at: int) -> int:
    """Write all of `view` at `at`; returns the offset after it."""
    view = view.cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], at + done)
    return at + done


def _u8():
    import torch  # lazy: torch only where a tensor is converted or compared; the direct copy is torch-free

    return torch.uint8


@dataclass(frozen=True)
class ExportResult:
    files: tuple[Path, ...]
    index: Path | None
    tensors: int
    bytes: int
    out: Path | None = None
    copies: tuple[Path, ...] = ()
    verified: int | None = None  # tensors compared by verify, None when not asked
    #: a many-process job (`_execute_job`): tensors written by this run and found finished in the journal, and
    #: each rank's figures ({rank, host, params (tensors), resumed, bytes, seconds})
    converted: int = -1
    resumed: int = 0
    ranks: tuple[dict, ...] = ()


def _index_doc(plan: ExportPlan) -> dict[str, Any]:
    return {
        "metadata": {"total_size": plan.nbytes},
        "weight_map": {t.name: f.name for f, s in zip(plan.files, plan.shards) for t in s},
    }


def _write_extras(plan: ExportPlan, folder: Path) -> None:
    """What goes beside the safetensors files in `folder`: the index, and with `hf` the config files."""
    if plan.index:
        (folder / plan.index.name).write_text(json.dumps(_index_doc(plan), indent=2))
    for c in plan.copies:
        shutil.copyfile(c, folder / c.name)
    if plan.config is not None:
        (folder / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")


def _targets(plan: ExportPlan) -> list[Path]:
    return [*plan.files, *([plan.index] if plan.index else [])]


def _occupied(folder: Path) -> bool:
    """Whether `folder` is a file or a folder with something in it (an empty folder is written over)."""
    try:
        return any(folder.iterdir())
    except NotADirectoryError:
        return True
    except FileNotFoundError:
        return False


def _refuse_existing(plan: ExportPlan) -> None:
    """An output that is there already, or a folder to write into that is not: refused before any work."""
    if plan.hf and _occupied(plan.out):
        raise CkptError(
            "output folder already exists and is not empty",
            path=plan.out,
            hint="choose a new folder or remove it first",
        )
    if not plan.hf:
        for f in _targets(plan):
            if f.exists():
                raise CkptError("output file already exists", path=f, hint="choose a new path or remove it first")
    if not plan.out.parent.is_dir():
        raise CkptError(
            f"the folder {plan.out.parent} does not exist",
            path=plan.out,
            hint=f"create it first: mkdir -p {plan.out.parent}",
        )


def execute(
    plan: ExportPlan,
    *,
    progress: Callable[[int], None] | None = None,
    verify: bool = False,
    distributed: bool = False,
    restart: bool = False,
) -> ExportResult:
    """Write the planned safetensors file(s) (and index, and for `hf` the config files); refuses to overwrite.
    All files are written under staging names and renamed into place only when every one is complete.

    With `distributed`, every rank of the initialised torch.distributed group (a torchrun job) calls this:
    `_execute_job`, the same bytes as one process. A job's staging folder left by an interrupted job is resumed
    by the same command, in one process too (`restart`: thrown away)."""
    _refuse_existing(plan)
    if distributed:
        import torch.distributed as dist  # lazy: torch only under torchrun (--distributed)

        if not dist.is_initialized():
            raise CkptError(
                "a many-process export needs torch.distributed: run it under torchrun",
                hint="torchrun --nproc-per-node N --no-python ckpt export CKPT OUT.safetensors",
            )
        return _execute_job(plan, shares.Job(dist.get_rank(), dist.get_world_size()), progress, verify, restart)
    if shares.job_staging(plan.out).exists():  # an interrupted job: resumed alone
        return _execute_job(plan, shares.LocalJob(), progress, verify, restart)
    if plan.hf:
        staging = plan.out.parent / f".ckpt-staging-{plan.out.name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            for f, tensors in zip(plan.files, plan.shards):
                _write_file(staging / f.name, tensors, progress)
            _write_extras(plan, staging)
            verified = len(verify_files(plan, {f: staging / f.name for f in plan.files})) if verify else None
            gate.check_output(staging, trust_pickles=False)  # safetensors and JSON: never a pickle
            if plan.out.exists():
                plan.out.rmdir()
            os.replace(staging, plan.out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return ExportResult(
            plan.files,
            plan.index,
            len(plan.tensors),
            plan.nbytes,
            plan.out,
            tuple(plan.out / c.name for c in plan.copies),
            verified,
        )

    targets = _targets(plan)
    staged = {f: f.parent / f".ckpt-staging-{f.name}-{os.getpid()}" for f in targets}
    try:
        for f, tensors in zip(plan.files, plan.shards):
            _write_file(staged[f], tensors, progress)
        if plan.index:
            staged[plan.index].write_text(json.dumps(_index_doc(plan), indent=2))
        verified = len(verify_files(plan, {f: staged[f] for f in plan.files})) if verify else None
        for f in targets:
            os.replace(staged[f], f)
    except BaseException:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    return ExportResult(plan.files, plan.index, len(plan.tensors), plan.nbytes, plan.out, (), verified)


# --- a torchrun job -----------------------------------------------------------------------------------------------


def plan_digest(plan: ExportPlan) -> str:
    """What identifies a plan's output (a job's staging folder is resumed only by the same plan): the files, each
    tensor's name, source, dtype and shape, and the config files' bytes."""
    layout = [
        [f.name, [[t.name, t.source.name, t.dtype, list(t.shape)] for t in s]] for f, s in zip(plan.files, plan.shards)
    ]
    copies = [hashlib.sha256(c.read_bytes()).hexdigest() for c in plan.copies]
    return hashlib.sha256(
        json.dumps([plan.to_json(), layout, copies], sort_keys=True, default=str).encode()
    ).hexdigest()


def _execute_job(
    plan: ExportPlan, job, progress: Callable[[int], None] | None, verify: bool, restart: bool
) -> ExportResult:
    """A torchrun job (`shares.run_job`), or one process resuming one. A unit is one tensor (with bytes): the rank
    that has it in its share writes its bytes into the staging file at the offset one process writes them
    (`_write_tensor`; the files grow to their planned size as the ranks write, holes until every share is in) and
    journals that span; rank 0 then writes each file's header, the index and the config files; every rank
    compares a share of the tensors with the source (`verify`: `_compare`), and rank 0 puts the output in place:
    the `hf` folder renamed, or the files renamed into OUT's folder (`io.put_files_in_place`)."""
    lay = _job_layout(plan)

    def check(staging: Path, share: list[int], first: bool) -> list[str]:
        """This rank's share of the comparison: the tensors of its units; rank 0 also the tensors without bytes
        and each file's list of names."""
        mine = {lay.where[k] for k in share}
        return _compare(
            plan,
            {f: staging / f.name for f in plan.files},
            only=lambda fi, ti: (fi, ti) in mine or (first and not plan.shards[fi][ti].nbytes),
            names=first,
        )[1]

    fig, figs = shares.run_job(
        job,
        plan.out,
        lay.units,
        digest=plan_digest(plan),
        restart=restart,
        convert=lambda todo, journal, counted: _write_share(plan, lay, todo, journal, counted),
        finish=lambda staging, _journal: _write_heads(plan, lay, staging),
        verify=check if verify else None,
        progress=progress,
        place=None if plan.hf else lambda staging: io.put_files_in_place(staging, _targets(plan)),
        empty_out_ok=plan.hf,  # an empty folder (checked above) stays until the output replaces it
        # files beside others: a file at OUT's own name is no output of a sharded export (one process leaves it too)
        targets=None if plan.hf else _targets(plan),
    )
    return ExportResult(
        plan.files,
        plan.index,
        len(plan.tensors),
        plan.nbytes if job.rank == 0 else fig["bytes"],
        plan.out,
        tuple(plan.out / c.name for c in plan.copies) if plan.hf else (),
        len(plan.tensors) if verify else None,
        converted=sum(f["params"] for f in figs),
        resumed=sum(f["resumed"] for f in figs),
        ranks=figs,
    )


@dataclass(frozen=True)
class _JobLayout:
    """Where a job writes, from the plan alone: each file's header, each tensor's offset and each file's size,
    and one unit per tensor with bytes (`where[k]`: its file index and its index in that file)."""

    heads: list[bytes]
    starts: list[list[int]]
    sizes: list[int]
    where: list[tuple[int, int]]
    units: list[shares.Unit]


def _job_layout(plan: ExportPlan) -> _JobLayout:
    """The offsets one process writes every byte at (`_write_file`), and the job's units."""
    heads = [_header(s, _METADATA) for s in plan.shards]
    starts: list[list[int]] = []
    for head, tensors in zip(heads, plan.shards):
        at, offsets = len(head), []
        for t in tensors:
            offsets.append(at)
            at += t.nbytes
        starts.append(offsets)
    sizes = [len(h) + sum(t.nbytes for t in s) for h, s in zip(heads, plan.shards)]
    where = [(fi, ti) for fi, s in enumerate(plan.shards) for ti, t in enumerate(s) if t.nbytes]
    units = [
        shares.Unit(
            f"{plan.files[fi].name}/{plan.shards[fi][ti].name}", plan.shards[fi][ti].nbytes, plan.shards[fi][ti].name
        )
        for fi, ti in where
    ]
    return _JobLayout(heads, starts, sizes, where, units)


def _write_share(plan: ExportPlan, lay: _JobLayout, todo: list[int], journal, counted: Callable[[int], None]) -> int:
    """This rank's units: each tensor's bytes at its offset in the staging file (which only grows to its planned
    size: the other ranks' bytes stay), each span journaled; returns the bytes written."""
    fds: dict[int, int] = {}
    src = FdCache()
    n = flushed = 0
    try:
        for k in todo:
            fi, ti = lay.where[k]
            t, name = plan.shards[fi][ti], plan.files[fi].name
            if fi not in fds:
                fds[fi] = os.open(journal.root / name, os.O_WRONLY | os.O_CREAT, 0o644)
                if os.fstat(fds[fi]).st_size < lay.sizes[fi]:  # only grows: the other ranks' bytes stay
                    os.ftruncate(fds[fi], lay.sizes[fi])
            if n - flushed >= _WRITEBACK_EVERY:  # the disk writes while the next tensors are copied
                for fd in fds.values():
                    start_writeback(fd)
                flushed = n
            _write_tensor(fds[fi], t, lay.starts[fi][ti], src, journal.root / name)
            journal.record(lay.units[k].rel, spans=[(name, lay.starts[fi][ti], t.nbytes)])
            counted(t.nbytes)
            n += t.nbytes
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
        src.close()
    return n


def _write_heads(plan: ExportPlan, lay: _JobLayout, staging: Path) -> None:
    """(rank 0) Each file's header, each file at its planned size, and the index and config files beside them."""
    for f, head, size in zip(plan.files, lay.heads, lay.sizes):
        fd = os.open(staging / f.name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            _pwrite(fd, memoryview(head), 0)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    _write_extras(plan, staging)


# --- verification -------------------------------------------------------------------------------------------------


class VerifyFailed(CkptError):
    """The written export does not read back equal to the source's logical tensors."""


def verify_files(plan: ExportPlan, where: dict[Path, Path] | None = None) -> list[str]:
    """Re-read every written tensor (one at a time) and compare it with the source's logical tensor, read again
    and converted to the output dtype: bit for bit, names, shapes and dtypes included. Returns the names
    compared; raises VerifyFailed naming the first differences."""
    done, bad = _compare(plan, where or {f: f for f in plan.files})
    if bad:
        raise VerifyFailed(
            f"the written export differs from the source in {len(bad)} tensors: {', '.join(bad[:5])}",
            path=plan.out,
            hint="nothing was put in place; report this with the checkpoint's format",
        )
    return done


def _compare(
    plan: ExportPlan,
    where: dict[Path, Path],
    only: Callable[[int, int], bool] | None = None,
    names: bool = True,
) -> tuple[list[str], list[str]]:
    """(names compared, differences) between the written files (`where`: planned path -> written path) and the
    source: the tensors `only(file index, tensor index)` accepts (all by default), and with `names` each file's
    set of names."""
    import torch  # lazy: the comparison reads tensors; plan and direct copy stay torch-free
    from safetensors import safe_open  # lazy: optional dependency, only for --verify

    bad: list[str] = []
    done: list[str] = []
    for fi, (f, tensors) in enumerate(zip(plan.files, plan.shards)):
        with safe_open(str(where[f]), framework="pt") as fh:
            if names:
                held, want = set(fh.keys()), {t.name for t in tensors}
                if held != want:
                    bad.append(
                        f"{f.name}: holds {sorted(held - want)[:3]} not planned, lacks {sorted(want - held)[:3]}"
                    )
                    continue
            for ti, t in enumerate(tensors):
                if only is not None and not only(fi, ti):
                    continue
                got = fh.get_tensor(t.name)
                ref = t.read()
                if (
                    got.dtype != ref.dtype
                    or tuple(got.shape) != tuple(ref.shape)
                    or not torch.equal(
                        got.view(-1).view(torch.uint8) if got.numel() else got,
                        ref.contiguous().view(-1).view(torch.uint8) if ref.numel() else ref,
                    )
                ):
                    bad.append(t.name)
                done.append(t.name)
    return done, bad
