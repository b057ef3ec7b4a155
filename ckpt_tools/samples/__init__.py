"""Regenerate the bundled sample checkpoints by running the real frameworks on CPU with gloo.

Each sample is made by a worker module in `ckpt_tools/samples/workers/`, launched with torchrun
(`nproc` ranks) so that DeepSpeed, FSDP and Accelerate all see a real process group. A worker writes
`<out>/<group>/<name>` (a folder or a file) and `<out>/<group>/<name>.manifest.json` beside it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..train.processes import free_port, stop_process_tree, worker_env  # noqa: F401 (free_port, worker_env: API)


@dataclass(frozen=True)
class SampleSpec:
    """How to make one sample: `python -m torch.distributed.run --nproc_per_node nproc -m module --sample name`."""

    name: str  # unique, e.g. "zero2_bf16"
    group: str  # folder under the output dir, e.g. "deepspeed"
    module: str  # worker module run under torchrun
    nproc: int
    path: str  # the checkpoint path relative to <out>/<group>, e.g. "zero2_bf16" or "plain.pt"
    after: tuple[str, ...] = field(default=())  # samples that must exist first (e.g. universal <- zero2)
    #: an environment variable the worker needs (Megatron-LM's training code is not on the package registries:
    #: MEGATRON_LM_DIR names a checkout of its tag core_v0.16.1)
    needs_env: str | None = None
    #: a package the worker imports that is not a dependency of ckpt (torchtitan and what it imports: see the
    #: worker's docstring for the versions measured)
    needs_module: str | None = None
    #: an environment variable naming the Python that runs the worker (a virtualenv with an older release of the
    #: producer, e.g. DeepSpeed 0.16.9), instead of this one
    python_env: str | None = None


_W = "ckpt_tools.samples.workers."
SAMPLES: tuple[SampleSpec, ...] = (
    SampleSpec("zero1_bf16", "deepspeed", _W + "ds_zero", 2, "zero1_bf16"),
    SampleSpec("zero2_bf16", "deepspeed", _W + "ds_zero", 2, "zero2_bf16"),
    SampleSpec("zero3_bf16", "deepspeed", _W + "ds_zero", 2, "zero3_bf16"),
    SampleSpec("zero2_fp32", "deepspeed", _W + "ds_zero", 2, "zero2_fp32"),
    SampleSpec("zero2_lambdalr", "deepspeed", _W + "ds_zero", 2, "zero2_lambdalr"),
    SampleSpec("zero2_warmuplr", "deepspeed", _W + "ds_zero", 2, "zero2_warmuplr"),
    SampleSpec("zero1_frozen", "deepspeed", _W + "ds_zero", 2, "zero1_frozen"),
    SampleSpec("zero1_tied_frozen", "deepspeed", _W + "ds_tied", 2, "zero1_tied_frozen"),
    SampleSpec("zero2_tied_frozen", "deepspeed", _W + "ds_tied", 2, "zero2_tied_frozen"),
    SampleSpec("zero3_tied_frozen", "deepspeed", _W + "ds_tied", 2, "zero3_tied_frozen"),
    SampleSpec(
        "zero2_bf16_universal", "universal", _W + "ds_universal", 1, "zero2_bf16_universal", after=("zero2_bf16",)
    ),
    SampleSpec("gpt_tp2_pp2", "megatron", _W + "ds_pipeline", 4, "gpt_tp2_pp2"),
    SampleSpec("gpt_tp2_pp2_noinfo", "megatron", _W + "ds_pipeline", 4, "gpt_tp2_pp2_noinfo"),
    SampleSpec("gpt_tp2_pp2_drifted", "megatron", _W + "ds_pipeline", 4, "gpt_tp2_pp2_drifted"),
    SampleSpec("gpt_tp2_pp2_dp2_drifted", "megatron", _W + "ds_pipeline", 8, "gpt_tp2_pp2_dp2_drifted"),
    SampleSpec("fsdp2_dcp", "fsdp", _W + "fsdp", 2, "fsdp2_dcp"),
    SampleSpec("fsdp1_sharded", "fsdp", _W + "fsdp", 2, "fsdp1_sharded"),
    SampleSpec("accelerate_ddp", "accelerate", _W + "accel", 2, "accelerate_ddp"),
    SampleSpec("accelerate_deepspeed", "accelerate", _W + "accel", 2, "accelerate_deepspeed"),
    # producers as users run them (the real-producers issue): HF Trainer, Lightning, DCP recipe
    # layouts, Accelerate with several models
    SampleSpec("hf_trainer_ddp", "hf_trainer", _W + "hf_trainer", 2, "hf_trainer_ddp"),
    SampleSpec("hf_trainer_zero2", "hf_trainer", _W + "hf_trainer", 2, "hf_trainer_zero2"),
    SampleSpec("lightning_onecycle", "lightning", _W + "lightning_run", 1, "onecycle.ckpt"),
    # torchtitan's own Trainer (torchtitan 0.3.0, FSDP2 on 2 gloo ranks): a full save (step-3) and the final
    # model-only save (step-5)
    SampleSpec("torchtitan_real", "dcp", _W + "torchtitan_run", 2, "torchtitan_real", needs_module="torchtitan"),
    SampleSpec("dcp_recipe_fsdp2", "dcp", _W + "dcp_layouts", 2, "dcp_recipe_fsdp2"),
    # torchtune 0.6.1's own recipes (full_finetune_single_device, lora_finetune_single_device; CPU): the output
    # folder with epoch_0/ (+ recipe_state/) and the final epoch_1/
    SampleSpec("torchtune_full", "torchtune", _W + "torchtune_run", 1, "torchtune_full", needs_module="torchtune"),
    SampleSpec("torchtune_lora", "torchtune", _W + "torchtune_run", 1, "torchtune_lora", needs_module="torchtune"),
    SampleSpec("accelerate_two_models", "accelerate", _W + "accel_multi", 2, "accelerate_two_models"),
    SampleSpec("plain", "torch", _W + "plain", 1, "plain.pt"),
    SampleSpec("safetensors_single", "safetensors", _W + "plain", 1, "model.safetensors"),
    SampleSpec("safetensors_sharded", "safetensors", _W + "plain", 1, "sharded"),
    # DeepSpeed Mixture-of-Experts (deepspeed.moe.layer.MoE, 4 experts, ep_size 2)
    SampleSpec("moe_zero2_bf16", "moe", _W + "ds_moe", 2, "moe_zero2_bf16"),
    SampleSpec("moe_stage0", "moe", _W + "ds_moe", 2, "moe_stage0"),
    # the same MoE run written by DeepSpeed 0.16.9 (`python -m venv --system-site-packages V; V/bin/pip install
    # deepspeed==0.16.9`; DEEPSPEED_0169_PYTHON=V/bin/python; set TORCH_EXTENSIONS_DIR apart from 0.19.8's)
    SampleSpec(
        "moe_zero2_bf16_ds0169", "moe", _W + "ds_moe", 2, "moe_zero2_bf16_ds0169", python_env="DEEPSPEED_0169_PYTHON"
    ),
    # Megatron-LM's own pretrain() + save_checkpoint (megatron-core 0.16.1 + a Megatron-LM checkout)
    *(
        SampleSpec(name, "megatron_lm", _W + "megatron_lm", 2, name, needs_env="MEGATRON_LM_DIR")
        for name in (
            "megatron_tp2_legacy",
            "megatron_tp2_torch_dist",
            "megatron_dp2_distopt_legacy",
            "megatron_dp2_distopt_torch_dist",
            "megatron_pp2_legacy",
            "megatron_pp2_torch_dist",
            "megatron_pp2_vpp2_legacy",
            "megatron_pp2_vpp2_torch_dist",
            "megatron_tp2_llama_legacy",
            "megatron_tp2_llama_torch_dist",
            "megatron_moe_ep2_torch_dist",
            "megatron_moe_ep2_legacy",
            "megatron_moe_ep2_distopt_torch_dist",
            "megatron_moe_ep2_distopt_legacy",
        )
    ),
)


def get_spec(name: str) -> SampleSpec:
    for s in SAMPLES:
        if s.name == name:
            return s
    raise KeyError(f"unknown sample {name!r}; known: {', '.join(s.name for s in SAMPLES)}")


def sample_path(out_dir: str | os.PathLike, name: str) -> Path:
    s = get_spec(name)
    return Path(out_dir) / s.group / s.path


def run_torchrun(
    module: str,
    nproc: int,
    args: list[str],
    *,
    log_path: Path | None = None,
    timeout: float = 600,
    python: str | None = None,
) -> None:
    """Run `module` under torchrun on localhost with `nproc` CPU ranks; raise with the log tail on failure."""
    cmd = [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        module,
        *args,
    ]
    # torchrun's workers run in sessions of their own: on Ctrl-C / SIGTERM / the timeout the whole tree is
    # stopped (not torchrun alone), and torchelastic's temp folders land in a folder removed afterwards
    with tempfile.TemporaryDirectory(prefix="ckpt-samples-") as tmp:
        env = worker_env()
        env["TMPDIR"] = tmp
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_tree(proc)
            raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s: stopped") from None
        finally:
            if proc.poll() is None:
                stop_process_tree(proc)
    if log_path is not None:
        log_path.write_text(out)
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-40:])
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{tail}")


def make_sample(out_dir: str | os.PathLike, name: str, *, log_dir: Path | None = None) -> Path:
    """(Re)make one sample under `out_dir`; returns the checkpoint path. Replaces an existing one."""
    spec = get_spec(name)
    out = Path(out_dir)
    if spec.needs_env and not os.environ.get(spec.needs_env):
        raise RuntimeError(
            f"sample {name} needs {spec.needs_env} (see {spec.module}'s docstring): set it, or "
            "leave this sample out with --only"
        )
    if spec.python_env and not os.environ.get(spec.python_env):
        raise RuntimeError(
            f"sample {name} is written by an older release of its producer: set {spec.python_env} to "
            "the Python of a virtualenv holding it (see ckpt_tools/samples/__init__.py), or leave this sample "
            "out with --only"
        )
    if spec.needs_module:
        if importlib.util.find_spec(spec.needs_module) is None:
            raise RuntimeError(
                f"sample {name} needs the {spec.needs_module} package (see {spec.module}'s "
                "docstring for the versions and install steps), or leave this sample out with --only"
            )
    for dep in spec.after:
        if not sample_path(out, dep).exists():
            make_sample(out, dep, log_dir=log_dir)
    target = out / spec.group / spec.path
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    (out / spec.group).mkdir(parents=True, exist_ok=True)
    log_path = (log_dir / f"{name}.log") if log_dir else None
    run_torchrun(
        spec.module,
        spec.nproc,
        ["--sample", name, "--out", str(out / spec.group)],
        log_path=log_path,
        python=os.environ.get(spec.python_env) if spec.python_env else None,
    )
    if not target.exists():
        raise RuntimeError(f"worker {spec.module} did not write {target}")
    return target
