"""Benchmark: `ckpt export` of a Megatron-LM legacy TP=2 checkpoint vs Megatron-LM's own TP merge
(`tools/checkpoint/convert.py`), side by side, plus a tensor-for-tensor comparison of what each wrote.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron_export.py --make --layers 96  # once
    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron_export.py --layers 96 --repeat 3

The checkpoint is `bench_megatron.py --make`'s (Megatron-LM's own `pretrain` on 2 gloo CPU ranks, the samples'
recipe made `--layers` deep): bench/out/megatron_L<layers>/megatron_tp2_legacy (one `model_optim_rng.pt` per TP
rank, bf16 weights in `model`, fp32 master in the optimizer state). `--make` here calls that same `make`.

Each command is a whole process, timed from spawn to exit with its peak RSS (`_util.run_measured`), runs
interleaved, medians of `--repeat`; every output is deleted (untimed) before the next run writes it again:

- `ckpt export RUN OUT.safetensors`: consolidated weights merged across TP, fp32 master (the default `--source
  fp32`); and `ckpt export --source module` (the bf16 module weights, what convert.py moves);
- Megatron-LM's `tools/checkpoint/convert.py --model-type GPT --loader core --saver core
  --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --loader-transformer-impl local
  --saver-transformer-impl local`: its loader builds Megatron-Core GPTModels for both TP ranks, loads each rank
  with Megatron's `load_checkpoint`, concatenates the TP shards and sends them over a queue to its saver (a
  forked process), which builds a TP=1 model and writes it with Megatron's `save_checkpoint` (legacy format,
  `iter_*/mp_rank_00/model_optim_rng.pt`, bf16 weights: the loader reads the module weights, never the fp32
  master). The peak RSS reported for it is the larger of the loader process and its saver child (the kernel's
  `ru_maxrss` over the waited process tree), not their sum: both are alive at once;
- `torch.load(weights_only=False)` of both rank files in one process (`bench_megatron.TORCH_LOAD`): the floor of
  reading them at all, no merge, nothing written (unpickling imports megatron.core, as it does for users);
- the reference's fixed cost: a process that only runs `import_megatron()` (Megatron's training code imported
  with the shims of change 1), converting nothing.

Then (untimed) one process loads ckpt's two exports and the checkpoint convert.py wrote and compares them tensor
for tensor: names (both use Megatron-Core's state-dict names, so the mapping is the identity), shapes, and values
(ckpt `--source module` vs Megatron's bf16 bit for bit; ckpt's fp32 master rounded to bf16 vs Megatron's bf16
bit for bit; the largest |fp32 master - bf16| as information).

Running convert.py on the CPU (Megatron-LM tag core_v0.16.1, megatron-core 0.16.1, no Apex, no
TransformerEngine). The reference is one Python process (`CONVERT` below) that calls convert.py's `main` with
`runpy.run_path`; convert.py starts its saver with multiprocessing, whose default start method on Linux is fork,
so everything set up before `main` is inherited by the saver. Run-time changes, nothing installed or checked out
is edited:

  1. The CPU shims of `ckpt_tools.samples.workers.megatron_lm.import_megatron()` (its docstring lists them:
     `torch.cuda` redirected to the CPU, CUDA RNG = CPU generator, a TorchFunctionMode mapping CUDA device
     arguments to the CPU, `compile_helpers` and `fused_kernels.load` no-ops, a `triton` stand-in during import,
     `jit_fuser` the identity), with `CUDA_DEVICE_MAX_CONNECTIONS=1` in the environment (Megatron's
     validate_args asserts it for TP > 1; the worker sets it the same way).
  2. `saver_base.version` (importlib.metadata.version as convert.py's saver bound it) answers "0.12.0" for
     "transformer-engine" when TransformerEngine is not installed: `insert_megatron_path_and_check_te` asserts TE
     >= 0.12.0 (for "CPU initialization") and otherwise raises PackageNotFoundError, although with
     `--saver-transformer-impl local` no TE module is used.
  3. `loader_core.MegatronCheckpointLoaderLLM.import_model_provider` returns the `partial(model_provider,
     gpt_builder)` it stores on `self.model_provider` instead of the bare `model_provider`: at this tag it returns
     the bare function, and `load_model_shards` then fails with "TypeError: model_provider() missing 1 required
     positional argument: 'model_builder'" (a bug of the tool, not of the CPU).
  4. In `initialize_megatron_env` of both the loader and the saver base classes, before the original runs: a
     single-rank gloo process group (world size 1, a file store). Megatron-Core 0.16 sizes every parallel layer by
     `get_pg_size(tp_group)`, which is 1 whenever torch.distributed is not initialized, so without it the loader
     builds TP=1-sized layers and `load_state_dict` fails with "size mismatch for embedding.word_embeddings.weight:
     copying a param with shape torch.Size([64, 64]) from checkpoint, the shape in current model is
     torch.Size([128, 64])". After the original: convert.py's own `_ConverterFakeProcessGroup` (size 1) for the
     parallel_state groups it does not fake and Megatron-Core asserts on: `_DATA_PARALLEL_GROUP`,
     `_DATA_PARALLEL_GROUP_WITH_CP`, `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` (GPTModel's default
     `ProcessGroupCollection.use_mpu_process_groups()`: "AssertionError: data parallel group is not initialized",
     the same failure as upstream issues NVIDIA/Megatron-LM#3080 and #3132), `_PIPELINE_MODEL_PARALLEL_GROUP` and
     `_EXPERT_DATA_PARALLEL_GROUP` (the saver's `save_checkpoint`: "pipeline_model parallel group is not
     initialized", "Expert data parallel group is not initialized"). Convert.py already fakes the TP and EP
     groups the same way; these are the ones it misses.
  5. The loader's Megatron argv (`build_sys_argv`) gets `--no-persist-layer-norm --no-gradient-accumulation-fusion`
     (the flags the checkpoint was trained with): without Apex, Megatron's LayerNorm is `WrappedTorchNorm`, which
     asserts "persist_layer_norm not supported by torch LayerNorm", and ColumnParallelLinear refuses gradient
     accumulation fusion without Apex's `fused_weight_gradient_mlp_cuda`. (The saver copies both from the
     checkpoint's args.)
  6. After `main` returns, the process exits 1 unless the save folder holds `latest_checkpointed_iteration.txt`:
     convert.py joins its saver but never checks the saver's exit code (a failed saver still exits 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (
    OUT_DIR,
    REPO_ROOT,
    ckpt_command,
    cpu_busy_fraction,
    machine_info,  # noqa: E402
    precompile,
    report_against,
    run_measured,
)
from bench.bench_megatron import TORCH_LOAD, arguments  # noqa: E402

CONVERT = r"""
import os, runpy, sys
load, save = sys.argv[1], sys.argv[2]
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
root = os.environ["MEGATRON_LM_DIR"]
from ckpt_tools.samples.workers import megatron_lm
megatron_lm.import_megatron()                                         # change 1
tools = os.path.join(root, "tools", "checkpoint")
sys.path.insert(0, tools)
import importlib.metadata as md
import loader_base, loader_core, saver_base
import torch.distributed as dist
from megatron.core import parallel_state as ps
from utils import _ConverterFakeProcessGroup

def version(name, _version=md.version):                               # change 2
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "transformer-engine":
            return "0.12.0"
        raise
saver_base.version = version

_import = loader_core.MegatronCheckpointLoaderLLM.import_model_provider
def import_model_provider(self):                                      # change 3
    provider = _import(self)
    return getattr(self, "model_provider", provider)
loader_core.MegatronCheckpointLoaderLLM.import_model_provider = import_model_provider

def with_groups(original):                                            # change 4
    def initialize_megatron_env(self):
        if not dist.is_initialized():
            from ckpt_tools.samples import free_port  # a TCP store: nothing left behind in /tmp

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
        original(self)
        for name in ("_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_WITH_CP",
                     "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_PIPELINE_MODEL_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP"):
            if getattr(ps, name) is None:
                setattr(ps, name, _ConverterFakeProcessGroup(size=1))
    return initialize_megatron_env
for cls in (loader_base.MegatronCheckpointLoaderBase, saver_base.MegatronCheckpointSaverBase):
    cls.initialize_megatron_env = with_groups(cls.initialize_megatron_env)

_argv = loader_base.MegatronCheckpointLoaderBase.build_sys_argv       # change 5
loader_base.MegatronCheckpointLoaderBase.build_sys_argv = lambda self: [
    *_argv(self), "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]

sys.argv = ["convert.py", "--model-type", "GPT", "--loader", "core", "--saver", "core",
            "--load-dir", load, "--save-dir", save,
            "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
            "--loader-transformer-impl", "local", "--saver-transformer-impl", "local"]
runpy.run_path(os.path.join(tools, "convert.py"), run_name="__main__")
if not os.path.isfile(os.path.join(save, "latest_checkpointed_iteration.txt")):   # change 6
    sys.exit("convert.py wrote no checkpoint: its saver failed (convert.py does not check the saver's exit code)")
"""

COMPARE = r"""
import glob, json, sys, torch
from safetensors.torch import load_file
fp32, module, ref_dir = sys.argv[1:4]
e, m = load_file(fp32), load_file(module)
ref_file, = glob.glob(ref_dir + "/iter_*/mp_rank_00/model_optim_rng.pt")
r = torch.load(ref_file, map_location="cpu", weights_only=False)["model"]
r = {k: v for k, v in r.items() if torch.is_tensor(v)}   # leaves out the `_extra_state` entries (not tensors)
common = sorted(set(e) & set(r))
out = {
    "ckpt_fp32_tensors": len(e), "ckpt_module_tensors": len(m), "megatron_tensors": len(r),
    "names_only_in_ckpt": sorted(set(e) - set(r)), "names_only_in_megatron": sorted(set(r) - set(e)),
    "dtypes": {"ckpt_fp32": sorted({str(v.dtype) for v in e.values()}),
               "ckpt_module": sorted({str(v.dtype) for v in m.values()}),
               "megatron": sorted({str(v.dtype) for v in r.values()})},
    "shapes_equal": sum(e[k].shape == r[k].shape for k in common),
    "module_bit_equal": sum(torch.equal(m[k], r[k]) for k in common),
    "fp32_as_bf16_bit_equal": sum(torch.equal(e[k].to(r[k].dtype), r[k]) for k in common),
    "max_abs_fp32_minus_megatron": max(float((e[k] - r[k].float()).abs().max()) for k in common),
    "elements": sum(r[k].numel() for k in common),
    "megatron_file_bytes": __import__("os").path.getsize(ref_file),
}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-torch-load", action="store_true", help="leave out the torch.load row")
    a, out = arguments(ap)
    megatron = os.environ.get("MEGATRON_LM_DIR")
    if not megatron:
        raise SystemExit("set MEGATRON_LM_DIR to a Megatron-LM checkout (tag core_v0.16.1)")
    legacy = out / "megatron_tp2_legacy"
    rank_files = sorted(str(p) for p in legacy.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    if len(rank_files) != 2:
        raise SystemExit(f"no TP=2 legacy checkpoint in {legacy}: run with --make --layers {a.layers}")
    work = OUT_DIR / f"megatron_export_L{a.layers}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fp32, module, ref = work / "ckpt_fp32.safetensors", work / "ckpt_module.safetensors", work / "megatron_tp1"
    precompile()
    ck = ckpt_command()
    cmds = {
        "ckpt export (fp32 master)": (ck + ["export", str(legacy), str(fp32)], fp32),
        "ckpt export --source module (bf16)": (ck + ["export", "--source", "module", str(legacy), str(module)], module),
        "Megatron convert.py core->core TP2->TP1 (bf16)": ([sys.executable, "-c", CONVERT, str(legacy), str(ref)], ref),
    }
    if not a.no_torch_load:
        cmds["torch.load both rank files"] = ([sys.executable, "-c", TORCH_LOAD, *rank_files], None)
    # the reference's fixed cost: importing Megatron's training code with the CPU shims, converting nothing
    cmds["floor: import_megatron() alone"] = (
        [sys.executable, "-c", "from ckpt_tools.samples.workers import megatron_lm as w; w.import_megatron()"],
        None,
    )
    env = dict(os.environ, MEGATRON_LM_DIR=megatron)
    runs: dict[str, list] = {k: [] for k in cmds}
    busy: list[float | None] = []  # how busy the CPUs were just before each run (other jobs inflate wall times)
    for _ in range(a.repeat):
        for name, (cmd, target) in cmds.items():
            if target is not None:  # a fresh output for every run, removed outside the timing
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            busy.append(cpu_busy_fraction())
            runs[name].append(run_measured(cmd, env=env, cwd=REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", COMPARE, str(fp32), str(module), str(ref)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"comparison failed:\n{proc.stderr[-4000:]}")
    comparison = json.loads(proc.stdout.strip().splitlines()[-1])
    sizes = {
        name: (
            target.stat().st_size
            if target.is_file()
            else sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        )
        for name, (_, target) in cmds.items()
        if target is not None
    }
    report_against(
        runs,
        "Megatron convert.py core->core TP2->TP1 (bf16)",
        "convert.py",
        "megatron_export_results.json",
        {
            "machine": machine_info(),
            "layers": a.layers,
            "checkpoint": str(legacy),
            "rank_file_bytes": [os.path.getsize(f) for f in rank_files],
            "output_bytes": sizes,
            "comparison": comparison,
        },
        busy,
    )
    print(json.dumps(comparison, indent=1))


if __name__ == "__main__":
    main()
