"""Benchmark: `ckpt convert STEP OUT --to megatron --hf-config CONFIG.json` of a torchtitan Llama (the way into
Megatron-LM) vs torch's own reference reader of the same save, `dcp_to_torch_save` (the first step of any
hand-written conversion: the whole checkpoint into one torch.save file), side by side, with peak memory.

    python bench/bench_titan_to_megatron.py --make --size 16,512,1536     # once: the real torchtitan Trainer
    python bench/bench_titan_to_megatron.py --size 16,512,1536 --repeat 3

`--make` runs the sample maker's real torchtitan 0.3.0 Trainer (`ckpt_tools.samples.workers.torchtitan_run`, FSDP2
over 2 gloo CPU ranks, the sample's recipe with a larger llama3: `--size LAYERS,DIM,HIDDEN`, 4 heads) and keeps its
`step-3` (weights, AdamW state, param groups) in bench/out/titan_<size>/. Needs torchtitan installed (see that
module's docstring). Each command is a whole process, timed from spawn to exit with its peak RSS
(`_util.run_measured`), runs interleaved, medians of `--repeat`; outputs deleted (untimed) between runs:

- `ckpt convert STEP OUT --to megatron --hf-config CONFIG.json --seq-length 32`: every tensor under Megatron-core
  names (q / k rows permuted, wq / wk / wv fused per query group, w1 / w3 as linear_fc1), bf16 module copy + fp32
  master + both Adam moments, written one parameter at a time, then verified by the logical diff against the whole
  source before it is put in place;
- `dcp_to_torch_save(STEP, FILE)`: torch's own conversion of the DCP folder to one torch.save file (no renaming, no
  Megatron layout): it loads every tensor into memory at once.

There is no Megatron-LM or torchtitan tool that writes a Megatron checkpoint from a torchtitan one to compare with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def folder(size: str) -> Path:
    return _util.OUT_DIR / f"titan_{size.replace(',', '_')}"


def make(size: str) -> Path:
    from ckpt_tools.samples import run_torchrun

    out = folder(size)
    shutil.rmtree(out, ignore_errors=True)
    run_torchrun(
        "ckpt_tools.samples.workers.torchtitan_run",
        2,
        ["--sample", "torchtitan_real", "--out", str(out), "--size", size],
        timeout=3600,
    )
    shutil.rmtree(out / "torchtitan_real" / "step-5", ignore_errors=True)  # the model-only final save
    return out


def hf_config(size: str, path: Path) -> Path:
    """The model's config.json as transformers writes it (4 heads, RoPE 5e5 with llama3 scaling, as the sample)."""
    from transformers import LlamaConfig

    layers, dim, hidden = (int(x) for x in size.split(","))
    LlamaConfig(
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        max_position_embeddings=8192,
    ).save_pretrained(path)
    return path / "config.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="16,512,1536", help="LAYERS,DIM,HIDDEN of the llama3 (4 heads)")
    p.add_argument("--make", action="store_true", help="train and save it with the real torchtitan Trainer first")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    if a.make:
        make(a.size)
    step = folder(a.size) / "torchtitan_real" / "step-3"
    if not step.is_dir():
        raise SystemExit(f"{step} is missing: run with --make first")
    work = folder(a.size) / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    cfg = hf_config(a.size, work / "cfg")
    out, full = work / "megatron", work / "full.pt"
    commands = {
        "ckpt convert --to megatron": [
            *_util.ckpt_command(),
            "convert",
            str(step),
            str(out),
            "--to",
            "megatron",
            "--hf-config",
            str(cfg),
            "--seq-length",
            "32",
            "--json",
        ],
        "dcp_to_torch_save": [
            sys.executable,
            "-c",
            "import sys; from torch.distributed.checkpoint.format_utils "
            "import dcp_to_torch_save; dcp_to_torch_save(sys.argv[1], sys.argv[2])",
            str(step),
            str(full),
        ],
    }
    _util.precompile()
    runs: dict[str, list] = {k: [] for k in commands}
    busy = []
    for _ in range(a.repeat):
        for name, cmd in commands.items():  # each command's own output removed (untimed) before it writes again
            if name.startswith("ckpt"):
                shutil.rmtree(out, ignore_errors=True)
            else:
                full.unlink(missing_ok=True)
            busy.append(_util.cpu_busy_fraction())
            runs[name].append(_util.run_measured(cmd, cwd=ROOT, stdout_path=work / f"{name.split()[0]}.out"))
    res = json.loads((work / "ckpt.out").read_text())
    result = {
        "machine": _util.machine_info(),
        "checkpoint": str(step),
        "checkpoint_bytes": _util.dir_bytes(step),
        "params": res["params"],
        "verified": res["verified"],
        "megatron_bytes": _util.dir_bytes(out),
        "torch_save_bytes": full.stat().st_size,
    }
    print(
        f"checkpoint {_util.fmt_bytes(result['checkpoint_bytes'])}; Megatron output "
        f"{_util.fmt_bytes(result['megatron_bytes'])} ({res['params']} tensors, verified {res['verified']}); "
        f"dcp_to_torch_save file {_util.fmt_bytes(result['torch_save_bytes'])}"
    )
    _util.report_against(runs, "dcp_to_torch_save", "dcp_to_torch_save", "titan_to_megatron_results.json", result, busy)


if __name__ == "__main__":
    main()
