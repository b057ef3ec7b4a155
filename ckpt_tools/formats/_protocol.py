"""The contract every format module in `FORMAT_MODULES` keeps: what `formats.detect` and the operations call on it.

A format module is a plain Python module; these Protocols type it (a module satisfies a Protocol structurally, by
its global names), so that the registry (`formats.detect`, `claim`, `enclosing`, `checkpoints_inside`,
`format_module`) can say what it returns. tests/test_format_protocol.py checks every module against them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from ..read.state import StateMap
from ..read.tree import Checkpoint


@runtime_checkable
class FormatModule(Protocol):
    """A module that reads one checkpoint format into the one tree (`read.tree.Checkpoint`)."""

    #: the format id `ckpt inspect` prints as `format` (and `Checkpoint.format` carries); unique across the
    #: modules of FORMAT_MODULES
    FORMAT: str

    def sniff(self, path: Path) -> bool:
        """Whether `path` (a file or folder) is a checkpoint of this format. Cheap: it may list a folder, stat
        files and read a few bytes or a small JSON/text marker file (a header, `latest`, `.metadata`'s presence),
        never read a whole checkpoint file nor unpickle one. False, not an error, for anything else;
        `detect` asks the modules in FORMAT_MODULES order and takes the first that says True."""
        ...

    def open(self, path: Path) -> Checkpoint:
        """The checkpoint at `path` as the tree: groups, values, and TensorNodes that point at byte ranges of
        the files (tensor data is read later, lazily, by `read.tensor_read`). It parses the pickles/headers
        it needs inertly (never `torch.load`), lists the files it holds (`Checkpoint.files`) and records
        what it found wrong as warnings; a checkpoint it cannot read raises a `CkptError` (NotACheckpoint,
        MissingFile, CorruptCheckpoint, UnsupportedCheckpoint) naming the file and the fix. Each module's own
        `open` docstring says which files it reads, which it only lists and what it leaves lazy."""
        ...


@runtime_checkable
class EditableFormatModule(FormatModule, Protocol):
    """A format module that also says where its training state lives; the formats without `training_state`
    are read-only for the writing commands (set-lr / set-step refuse them with a hint)."""

    def training_state(self, ck: Checkpoint) -> StateMap:
        """Where `ck`'s (a checkpoint this module opened) learning rates, step counters and optimizer state
        live: a StateMap naming the files (StateSources: a rank file, the DCP `.metadata`, an optimizer.pt,
        with the optimizer index where a file holds several) that set-lr / set-step / tp-sync load and search
        by shape, or a read-only StateMap saying why they would not edit it. Cheap: it works from `ck`
        (its files and details), at most lists a folder or reads a small marker file (`latest`); it loads
        no pickle itself."""
        ...


class UniversalSource(NamedTuple):
    """What `ckpt to-universal` converts, as a format module's `universal_source` hook finds it."""

    ck: Checkpoint  #: the checkpoint, opened by its reader (with the user's TP patterns where it takes them)
    tag_dir: Path  #: the DeepSpeed tag folder holding the rank files (`mp_rank_*` / `*_optim_states.pt`)
    kind: str  #: "pipeline" (Megatron-DeepSpeed layer files) or "zero" (ZeRO partitions)
    opened_at: Path  #: the path `ck` was opened from: the one its refusals and accounting name


@runtime_checkable
class UniversalSourceModule(FormatModule, Protocol):
    """A format module whose checkpoints `ckpt to-universal` converts (those that hold a DeepSpeed tag folder).
    `ops.to_universal` asks the module, never branches on which module it is."""

    def universal_source(self, path: Path, tp_patterns: tuple[str, ...] = ()) -> UniversalSource:
        """The checkpoint at `path` opened for conversion to a DeepSpeed universal checkpoint, with its tag
        folder; a `CkptError` naming the fix where `path` holds no DeepSpeed tag folder."""
        ...
