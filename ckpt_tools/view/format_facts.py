"""What a checkpoint's tree is, as the operations ask it: the one place outside `formats/` that reads the format id
a reader set (`Checkpoint.format`), so that no operation branches on a format by name.

Each fact is a table keyed by the format id; a format module should later declare its own entry (e.g. a
`PARAM_NAMING = "megatron_core"` beside its `FORMAT`), and these tables then read it from `formats.FORMAT_MODULES`.
"""

from __future__ import annotations

#: whose parameter names a format's tree holds, where a conversion renames them (`view.megatron_core`):
#: Megatron-core's (`decoder.layers.N.…`) or Megatron-DeepSpeed's pipeline names (`<layer spec>.<local name>`)
PARAM_NAMING = {
    "megatron_legacy": "megatron_core",
    "megatron_torch_dist": "megatron_core",
    "deepspeed_pipeline": "megatron_deepspeed",
}
#: the format id each `ckpt convert --to` target writes (a source already in it has nothing to convert)
WRITTEN_AS = {"dcp": "dcp", "deepspeed-universal": "deepspeed_universal"}
#: the format id of a PyTorch Distributed Checkpoint save (torchtitan, FSDP2, a recipe's AppState)
DCP = "dcp"


def param_naming(ck) -> str | None:
    """ "megatron_core", "megatron_deepspeed" or None: whose names the model tensors of `ck` carry."""
    return naming_of_format(ck.format)


def naming_of_format(format_id: str) -> str | None:
    """`param_naming` of a checkpoint of format `format_id` (a plan records its source's format id)."""
    return PARAM_NAMING.get(format_id)


def already_in(ck, target: str) -> bool:
    """The source is already in the format the `--to target` writes."""
    return target in WRITTEN_AS and ck.format == WRITTEN_AS[target]


def is_dcp(ck) -> bool:
    """`ck` is a PyTorch Distributed Checkpoint save (a `.metadata` and `.distcp` files)."""
    return ck.format == DCP
