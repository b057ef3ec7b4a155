"""The DeepSpeed universal sample: DeepSpeed's own `ds_to_universal` run on the zero2_bf16 sample.

Using the real converter (not our own) makes this sample the reference that `ckpt to-universal` is
checked against. `--inject_missing_state` is needed because DeepSpeed's engine writes no
`universal_checkpoint_info` for a plain model; at TP=1 the injected empty info is correct.

No training happens here, so the manifest's counters, LR and parameter counts are the source sample's
(the converter copies the model states and the optimizer step unchanged).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ckpt_tools.samples import get_spec, sample_path
from ckpt_tools.train.manifest import manifest_path, write_manifest
from ckpt_tools.samples.workers import _common as c

SOURCE = {"zero2_bf16_universal": "zero2_bf16"}


def convert(source: Path, target: Path) -> list[str]:
    """Convert the `latest` tag of the DeepSpeed checkpoint folder `source` into `target/<tag>_universal`.

    The converter writes `latest_universal` into the parent of its output folder, so `target` ends up
    laid out like a DeepSpeed checkpoint folder. Returns the command that was run.
    """
    tag = (source / "latest").read_text().strip()
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source / tag),
        "--output_folder",
        str(target / f"{tag}_universal"),
        "--inject_missing_state",
        "--num_extract_workers",
        "2",
        "--num_merge_workers",
        "1",
    ]
    target.mkdir(parents=True)
    subprocess.run(cmd, check=True)
    return cmd


def main() -> None:
    args = c.parse_args()
    if c.rank() != 0:
        return
    source_name = SOURCE[args.sample]
    # The source sample lives in its own group folder beside ours (<out>/../<group>/<name>).
    source = sample_path(args.out.parent, source_name)
    target = args.out / args.sample
    cmd = convert(source, target)
    src = json.loads(manifest_path(source).read_text())
    write_manifest(
        target,
        sample=args.sample,
        format="deepspeed_universal",
        world_size=src["world_size"],
        topology=src["topology"],
        steps=src["steps"],
        counters=src["counters"],
        lr=src["lr"],
        parameters=src["parameters"],
        extra={
            "source_sample": source_name,
            "source_group": get_spec(source_name).group,
            "converter": " ".join(["python", *cmd[1:]]).replace(str(args.out.parent) + "/", "<out>/"),
            "note": "counters, lr, parameters, topology and history are the source sample's: the universal "
            "checkpoint is a conversion of it, not a new training run",
            "history": src["extra"]["history"],
            "history_note": src["extra"]["history_note"],
            "ds_config": src["extra"]["ds_config"],
            "dtype": src["extra"]["dtype"],
        },
    )


if __name__ == "__main__":
    main()
