"""torchtune samples made by torchtune's OWN recipes (not an imitation), one process on CPU.

Measured with torchtune 0.6.1 (+ torchao 0.11.0, torchdata 0.11.0), torch 2.13.0+cpu, transformers 5.24.0,
datasets 5.2.0, tiktoken 0.14.0, omegaconf 2.4.0, Python 3.11 (2 CPU cores, no GPU). Run as our sample tool
does (torchrun with one process; plain `python -m` works the same):

    python -m torch.distributed.run --nproc_per_node 1 -m ckpt_tools.samples.workers.torchtune_run \\
        --sample torchtune_full --out DIR

What runs: the recipe file torchtune ships (`<site-packages>/recipes/full_finetune_single_device.py`, found
through torchtune's recipe registry the way `tune run full_finetune_single_device` finds it) is loaded with
`runpy.run_path` (as `tune run` does; the `recipes` package itself refuses imports); the config is a YAML file
written to a temporary folder and parsed by torchtune's own `TuneRecipeArgumentParser` +
`_merge_yaml_and_cli_args` (what the recipe's `@config.parse` does with `--config FILE key=value ...`); then
the body of the recipe's `recipe_main` runs step by step: `config.log_config`, `FullFinetuneRecipeSingleDevice(cfg)`,
`.setup(cfg)`, [the observers below are attached], `.train()`, `.cleanup()`. The saves are the recipe's own
`save_checkpoint` -> `FullModelHFCheckpointer.save_checkpoint`: nothing in this module writes into the sample.

Inputs (written to a temporary folder, nothing downloaded; the folder is removed at the end):
- the "pretrained" model: `transformers.LlamaForCausalLM(LlamaConfig(...)).save_pretrained(...)` (seed 0):
  2 layers, hidden 64, 4 heads, 2 KV heads (GQA, head_dim 16), intermediate 128, vocab 128, RoPE theta 5e5,
  untied lm_head -> `config.json`, `generation_config.json`, `model.safetensors` (the only files in that folder,
  since FullModelHFCheckpointer copies every non-weight file of `checkpoint_dir` into each `epoch_N/`).
  The recipe's model is torchtune's own component builder `torchtune.models.llama3.llama3` with the same dims
  (`model_type: LLAMA3`), so the checkpointer converts HF <-> torchtune names (and un/permutes q/k) itself.
- the tokenizer: torchtune's `torchtune.models.llama3.llama3_tokenizer` on a tiny tiktoken BPE file trained here
  (96 single bytes: printable ASCII + newline, then 22 merges learned from the corpus = 118 ranks) and a
  `special_tokens.json` (HF `tokenizer.json`-style `added_tokens`, read by torchtune's `special_tokens_path`)
  with the 10 special tokens Llama3Tokenizer needs at ids 118-127; `max_seq_len` 32.
- the data: 16 lines of JSON (`{"text": ...}`) read by torchtune's `text_completion_dataset(source="json",
  data_files=...)` (HF `datasets`' json builder; its cache goes to the temporary folder).

The run (`full_finetune_single_device`): device cpu, dtype fp32, batch 2, shuffle, seed 1234, `epochs: 2`,
`max_steps_per_epoch: 3`, gradient_accumulation_steps 1, `torch.optim.AdamW` (lr 1e-3, weight decay 0.01),
`torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup` (num_warmup_steps 2, num_training_steps 6 set
by the recipe: LR factors 0, 0.5, 1, 0.854, 0.5, 0.146 for steps 1-6), `CEWithChunkedOutputLoss`, compile False,
DiskLogger into the temporary folder. torchtune 0.6.1 has no `save_every_n_steps`: the recipe saves at the end of
each epoch. `output_dir` (and the checkpointer's) is the sample folder, which then holds exactly what torchtune
wrote:
- `epoch_0/` (after step 3, the intermediate save): `model-00001-of-00001.safetensors` (HF names, q/k permuted
  back to HF's rotary layout), `model.safetensors.index.json`, and `config.json` + `generation_config.json`
  copied from the input folder;
- `recipe_state/recipe_state.pt` (written with the epoch_0 save only): `seed`, `epochs_run` (1), `total_epochs`,
  `max_steps_per_epoch`, `dataloader` (StatefulDataLoader state), `optimizer` (AdamW state dict; integer ids in
  the model's parameter order). No global step and no scheduler state: on resume the recipe sets
  global_step = epochs_run * steps_per_epoch and rebuilds the LambdaLR with last_epoch = global_step - 1, whose
  base LR is each group's saved `initial_lr`;
- `epoch_1/` (after step 6, the final save: model only, no recipe state);
- `torchtune_config.yaml` (written by torchtune's DiskLogger.log_config into cfg.output_dir; its paths name the
  temporary input folder, gone after the run).
The folder a user resumes from is `epoch_0` + `recipe_state/recipe_state.pt` (`resume_from` in the manifest).

`torchtune_lora` (`lora_finetune_single_device`, same inputs and run, AdamW lr 1e-3): the model is
`torchtune.models.llama3.lora_llama3` (LoRA rank 8, alpha 16 on q_proj and v_proj, dropout 0),
`save_adapter_weights_only: True`. Each `epoch_N/` holds `adapter_model.pt` (torchtune names),
`adapter_model.safetensors` (PEFT names, q lora_b permuted to HF's layout), `adapter_config.json` (PEFT) and the
copied `config.json` + `generation_config.json`; `recipe_state/recipe_state.pt` as above, with an optimizer built
over ALL 29 model parameters (the frozen base weights are in param_groups' ids 0..28) but state only for the 8
adapter parameters (ids 2, 3, 6, 7, 15, 16, 19, 20; the frozen ones never get a gradient). A LoRA resume in 0.6.1
reads the BASE model from `checkpoint_dir` (the original pretrained folder) plus `epoch_N/adapter_model.pt`; the
check mode below rebuilds the identical pretrained folder (same seed) in its temporary folder for that.
Why adapter-only: with the recipe default `save_adapter_weights_only: False` the run works, but on CPU each save
corrupts the live model: `save_checkpoint` builds `{k: v.cpu() ...}` (no copy on CPU) and `get_merged_lora_ckpt`
merges with `state_dict[f"{module}.weight"] += ...`, i.e. INTO the live frozen base weights (measured: after the
epoch_0 save layers.0 q_proj/v_proj base weights differ from the pretrained ones by up to 1.4e-3, k_proj by 0),
so the uninterrupted run trains on base + 2 x delta after each save and an untouched resume reproduces its LRs but
not its losses (step 4: 4.8770 resumed vs 4.8739 uninterrupted). Adapter-only saves skip the merge.

Run-time changes: NONE to torchtune's behaviour (no installed file is edited, no torchtune function or class is
replaced; both recipes run on CPU as shipped). What this module does at run time, all observation or
environment:
1. observers on the live recipe after `setup` (no behaviour change): `register_step_pre_hook` /
   `register_step_post_hook` on the recipe's optimizer (the LR of each param group used by each update, Adam's
   step after it), the recipe's `_metric_logger.log_dict` wrapped (instance attribute) to record what torchtune
   logged (loss; its `lr` is read AFTER the scheduler stepped, i.e. the next step's LR), and the recipe's
   `_checkpointer.save_checkpoint` wrapped (instance attribute) to snapshot, just before each save, the recipe's
   counters, optimizer param groups, scheduler, the keys handed to the checkpointer and afterwards the files it
   wrote. Check mode with `--steps K` short of the schedule raises a private exception from the `log_dict`
   wrapper after step K is logged (the run then stops before saving anything).
2. environment: `HF_DATASETS_CACHE` -> the temporary folder, `HF_HUB_OFFLINE=1`, `HF_DATASETS_OFFLINE=1`,
   `TIKTOKEN_CACHE_DIR=""` (tiktoken otherwise caches every local BPE file it loads in /tmp/data-gym-cache,
   keyed by path).
3. the config's `output_dir` + checkpointer `output_dir` = the sample folder (make) or a scratch copy of it
   (check); `metric_logger.log_dir` = the temporary folder (torchtune's own configs use `${output_dir}/logs`).
Packages (import-time needs of torchtune 0.6.1, installed with --no-deps next to torch 2.13.0+cpu): torchtune
0.6.1, torchao 0.11.0, torchdata, omegaconf, tiktoken, blobfile, sentencepiece, kagglehub, datasets (+ pyarrow).

Observed (torchtune 0.6.1 behaviour, kept as is): `_setup_data` receives the saved dataloader state but never loads
it (the sampler's per-epoch shuffle makes the resumed epoch's batches those of the uninterrupted run anyway); the
LoRA recipe sets global_step on resume only when max_steps_per_epoch < batches per epoch (true here: 3 < 8).

Check mode (resume in torchtune's own recipe):

    python -m ckpt_tools.samples.workers.torchtune_run --sample torchtune_full \\
        --check DIR/torchtune_full[/epoch_0] --record OUT.json [--steps K] [--tune-arg key=value ...]

relaunches the same recipe with the same config plus `resume_from_checkpoint: True`, as torchtune 0.6.1's
FullModelHFCheckpointer resumes: it reads the model files and the recipe state RELATIVE TO ITS `output_dir`,
needs an `epoch_N` folder there (with `should_load_recipe_state` and no `adapter_checkpoint` it looks for the
largest epoch's adapter_model.pt, and fails on a folder without epoch_N: "join() argument must be str ... not
'NoneType'"), and the resumed run saves into it. So `output_dir` (cfg + checkpointer) is a scratch COPY of the
sample folder (removed afterwards; the sample is only read, and its sha256 digests are compared before/after),
with `checkpoint_files` = `epoch_N/model-*.safetensors`, `checkpoint_dir` = the sample's `epoch_N` folder (its
copied `config.json`), `recipe_checkpoint` = `recipe_state/recipe_state.pt`; LoRA: `checkpoint_dir` = the
pretrained folder rebuilt identically (seed 0) in the temporary folder, `adapter_checkpoint` =
`epoch_N/adapter_model.pt`. It trains K steps (default: the rest of the schedule, 3; fewer: the run is stopped
after step K, before any save) and writes per step the LR of each param group the update used, torchtune's logged
loss and the step, compared with the manifest's history (the uninterrupted run) when a manifest is beside the
sample. `--tune-arg key=value` adds a torchtune config override as on the `tune run` command line (e.g.
`optimizer.lr=5e-4`, which a resume ignores: `optimizer.load_state_dict` restores each group's `lr` and
`initial_lr`, and the rebuilt LambdaLR takes `initial_lr`).

Measured (this machine, 2 CPU cores): make 19-32 s per sample, check 15-26 s; an untouched resume from
`epoch_0` reproduces the uninterrupted run's steps 4-6 exactly (LR and loss) for both samples; with
`initial_lr` edited to 5e-4 in a copy's recipe_state.pt the first resumed step uses 5e-4 x 0.854 = 4.27e-4.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import importlib.metadata as md
import json
import os
import random
import re
import runpy
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ckpt_tools.samples.workers._common import check_mode_parser, param_group_value, shared_adam_step
from ckpt_tools.train.manifest import write_manifest

SAMPLES = ("torchtune_full", "torchtune_lora")
RECIPES = {"torchtune_full": "full_finetune_single_device", "torchtune_lora": "lora_finetune_single_device"}
TORCHTUNE_VERSION = "0.6.1"

# model: HF LlamaForCausalLM written by transformers; torchtune's llama3 component builder with the same dims
VOCAB, DIM, N_LAYERS, N_HEADS, N_KV_HEADS, INTERMEDIATE = 128, 64, 2, 4, 2, 128
MODEL_MAX_SEQ_LEN, ROPE_BASE, NORM_EPS = 64, 500_000, 1e-5
# LoRA (torchtune_lora)
LORA_RANK, LORA_ALPHA, LORA_MODULES = 8, 16.0, ("q_proj", "v_proj")
# tokenizer: 96 single-byte ranks + merges + 10 special tokens = VOCAB
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
BASE_BYTES = [b for b in range(32, 127)] + [10]
N_MERGES = VOCAB - len(SPECIAL_TOKENS) - len(BASE_BYTES)
TOKENIZER_MAX_SEQ_LEN = 32
# data + run
N_EXAMPLES, BATCH, EPOCHS, MAX_STEPS_PER_EPOCH = 16, 2, 2, 3
LR, WEIGHT_DECAY, WARMUP = 1e-3, 0.01, 2
SEED, MODEL_SEED = 1234, 0

HISTORY_NOTE = (
    "one entry per optimizer step of the uninterrupted run: 'step' is the recipe's global_step after the update "
    "(1-based), 'epoch' the epoch it belongs to, 'lr' the LR of each param group that update used (read in an "
    "optimizer step pre-hook), 'lr_after' after the recipe stepped the scheduler, 'optimizer_step' Adam's step "
    "count after it, 'loss' and 'logged_lr' what torchtune's metric logger got (its lr is read after the scheduler "
    "step, i.e. it is the NEXT step's LR); the save of epoch_0 happens after step 3, epoch_1 after step 6"
)

_WORDS = (
    "the recipe saves an epoch folder and a recipe state while the optimizer keeps two moments for each "
    "weight and the scheduler warms the learning rate up then decays it on a cosine to zero at the end of "
    "training the checkpointer converts names between hugging face and torchtune layouts"
).split()


# --- inputs: pretrained HF model, tokenizer, data ---------------------------------------------------------------


def corpus() -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for _ in range(N_EXAMPLES):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 16))]
        lines.append(" ".join(words).capitalize() + ".")
    return lines


def train_bpe(texts: list[str]) -> dict[bytes, int]:
    """A tiny byte-level BPE in tiktoken's format: single bytes (ranks 0..95), then N_MERGES merges, each the most
    frequent adjacent pair in the corpus's pre-tokenized pieces (CL100K pattern, as Llama3Tokenizer splits)."""
    # torchtune and its dependencies are imported only in this worker, after set_env() (huggingface_hub and datasets
    # read the HF_* settings at import); the same for every torchtune import below
    # lazy: as said above
    import regex
    from torchtune.models.llama3._tokenizer import CL100K_PATTERN

    ranks: dict[bytes, int] = {bytes([b]): i for i, b in enumerate(BASE_BYTES)}
    pieces = collections.Counter(p.encode() for t in texts for p in regex.findall(CL100K_PATTERN, t))
    words = {p: [bytes([b]) for b in p] for p in pieces}
    while len(ranks) < len(BASE_BYTES) + N_MERGES:
        pairs: collections.Counter = collections.Counter()
        for p, parts in words.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += pieces[p]
        if not pairs:
            raise RuntimeError("corpus too small for the BPE merges")
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for p, parts in words.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            words[p] = merged
    return ranks


def write_inputs(folder: Path) -> dict[str, Path]:
    """The pretrained HF folder (only the files transformers writes), the tokenizer files and the data."""
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: after set_env(), as in train_bpe

    special = {tok: VOCAB - len(SPECIAL_TOKENS) + i for i, tok in enumerate(SPECIAL_TOKENS)}
    hf = folder / "pretrained"
    hf_config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        max_position_embeddings=MODEL_MAX_SEQ_LEN,
        rope_theta=float(ROPE_BASE),
        rms_norm_eps=NORM_EPS,
        tie_word_embeddings=False,
        bos_token_id=special["<|begin_of_text|>"],
        eos_token_id=special["<|end_of_text|>"],
    )
    torch.manual_seed(MODEL_SEED)
    LlamaForCausalLM(hf_config).save_pretrained(str(hf))

    texts = corpus()
    tok = folder / "tokenizer"
    tok.mkdir(parents=True)
    ranks = train_bpe(texts)
    (tok / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    )
    (tok / "special_tokens.json").write_text(
        json.dumps({"added_tokens": [{"id": i, "content": t, "special": True} for t, i in special.items()]}, indent=1)
    )
    data = folder / "data"
    data.mkdir()
    (data / "train.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return {
        "pretrained": hf,
        "tokenizer": tok / "tokenizer.model",
        "special_tokens": tok / "special_tokens.json",
        "data": data / "train.json",
    }


# --- the config ------------------------------------------------------------------------------------------------


def _model_section(sample: str) -> dict[str, Any]:
    """The config's `model:` section: torchtune's llama3 builder (or its LoRA variant) with the sample's sizes."""
    model: dict[str, Any] = {
        "vocab_size": VOCAB,
        "num_layers": N_LAYERS,
        "num_heads": N_HEADS,
        "num_kv_heads": N_KV_HEADS,
        "embed_dim": DIM,
        "max_seq_len": MODEL_MAX_SEQ_LEN,
        "intermediate_dim": INTERMEDIATE,
        "rope_base": ROPE_BASE,
        "norm_eps": NORM_EPS,
    }
    if sample != "torchtune_lora":
        return {"_component_": "torchtune.models.llama3.llama3", **model}
    return {
        "_component_": "torchtune.models.llama3.lora_llama3",
        "lora_attn_modules": list(LORA_MODULES),
        "apply_lora_to_mlp": False,
        "apply_lora_to_output": False,
        **model,
        "lora_rank": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
    }


def recipe_config(sample: str, inputs: dict[str, Path], *, output_dir: Path, log_dir: Path) -> dict[str, Any]:
    """The YAML config (as a dict) a user would write for this run, in the layout of torchtune's own configs."""
    model = _model_section(sample)
    cfg: dict[str, Any] = {
        "output_dir": str(output_dir),
        "model": model,
        "tokenizer": {
            "_component_": "torchtune.models.llama3.llama3_tokenizer",
            "path": str(inputs["tokenizer"]),
            "special_tokens_path": str(inputs["special_tokens"]),
            "max_seq_len": TOKENIZER_MAX_SEQ_LEN,
        },
        "dataset": {
            "_component_": "torchtune.datasets.text_completion_dataset",
            "source": "json",
            "data_files": str(inputs["data"]),
            "column": "text",
            "split": "train",
            "packed": False,
        },
        "seed": SEED,
        "shuffle": True,
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(inputs["pretrained"]),
            "checkpoint_files": ["model.safetensors"],
            "recipe_checkpoint": None,
            "output_dir": "${output_dir}",
            "model_type": "LLAMA3",
        },
        "resume_from_checkpoint": False,
        "batch_size": BATCH,
        "epochs": EPOCHS,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY, "fused": False},
        "lr_scheduler": {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": WARMUP,
        },
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "max_steps_per_epoch": MAX_STEPS_PER_EPOCH,
        "gradient_accumulation_steps": 1,
        "clip_grad_norm": None,
        "compile": False,
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(log_dir)},
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }
    if sample == "torchtune_lora":
        cfg["save_adapter_weights_only"] = True
    else:
        cfg["optimizer_in_bwd"] = False
    return cfg


# --- running torchtune's recipe ----------------------------------------------------------------------------------


def recipe_file(sample: str) -> Path:
    """The recipe file `tune run <name>` executes (torchtune's registry; ROOT/recipes/<file_path>)."""
    # lazy: torchtune, after set_env() (see train_bpe)
    import torchtune
    from torchtune._recipe_registry import get_all_recipes

    name = RECIPES[sample]
    entry = next(r for r in get_all_recipes() if r.name == name)
    path = Path(torchtune.__file__).resolve().parent.parent / "recipes" / entry.file_path
    if not path.is_file():
        raise RuntimeError(f"torchtune recipe {name} not found at {path}")
    return path


def recipe_class(sample: str):
    """Load the recipe file as `tune run` does (runpy.run_path; not as __main__, so recipe_main does not start)."""
    g = runpy.run_path(str(recipe_file(sample)), run_name=f"torchtune_recipe_{RECIPES[sample]}")
    name = "FullFinetuneRecipeSingleDevice" if sample == "torchtune_full" else "LoRAFinetuneRecipeSingleDevice"
    return g[name]


def parse_config(cfg_file: Path, overrides: list[str]):
    """What the recipe's `@config.parse` does with `--config FILE key=value ...` (without its sys.exit)."""
    # lazy: torchtune, after set_env() (see train_bpe)
    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _merge_yaml_and_cli_args

    parser = TuneRecipeArgumentParser(description="torchtune recipe config")
    yaml_args, cli_args = parser.parse_known_args(["--config", str(cfg_file), *overrides])
    return _merge_yaml_and_cli_args(yaml_args, cli_args)


class StopCheck(Exception):
    """Raised by the check mode's observer after the requested number of resumed steps."""


class Recorder:
    """Observers on a live recipe (after setup): optimizer step hooks, metric logger, checkpointer saves."""

    def __init__(self, recipe, *, stop_after: int | None = None) -> None:
        self.recipe = recipe
        self.history: list[dict[str, Any]] = []
        self.saves: list[dict[str, Any]] = []
        self.stop_after = stop_after
        opt = recipe._optimizer
        opt.register_step_pre_hook(self._pre_step)
        opt.register_step_post_hook(self._post_step)
        log_dict = recipe._metric_logger.log_dict
        save = recipe._checkpointer.save_checkpoint

        def recorded_log_dict(payload, step):
            out = log_dict(payload, step)
            h = self.history[-1]
            if h["step"] != step:
                raise RuntimeError(f"logged step {step} != recorded step {h['step']}")
            h["loss"] = float(payload["loss"])
            h["logged_lr"] = float(payload["lr"])
            h["lr_after"] = self.group_values("lr")
            h["scheduler_last_epoch"] = self.scheduler().last_epoch
            h["global_step"] = recipe.global_step
            if self.stop_after is not None and len(self.history) >= self.stop_after:
                raise StopCheck()
            return out

        def recorded_save(state_dict, *args, **kwargs):
            snap = self.snapshot(state_dict, *args, **kwargs)
            out = save(state_dict, *args, **kwargs)
            outdir = Path(recipe._checkpointer._output_dir)
            snap["files_written"] = _listing(outdir / snap["folder"], prefix=snap["folder"])
            if snap["intermediate"]:
                snap["files_written"].update(_listing(outdir / "recipe_state", prefix="recipe_state"))
            self.saves.append(snap)
            return out

        recipe._metric_logger.log_dict = recorded_log_dict
        recipe._checkpointer.save_checkpoint = recorded_save

    def scheduler(self):
        return self.recipe._lr_scheduler

    def group_values(self, key: str) -> list[Any]:
        return [param_group_value(g.get(key)) for g in self.recipe._optimizer.param_groups]

    def adam_steps(self) -> list[int]:
        return sorted({int(s["step"]) for s in self.recipe._optimizer.state.values() if "step" in s})

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self.history.append(
            {"step": self.recipe.global_step + 1, "epoch": self.recipe.epochs_run, "lr": self.group_values("lr")}
        )

    def _post_step(self, optimizer, args, kwargs) -> None:
        self.history[-1]["optimizer_step"] = shared_adam_step(self.adam_steps())

    def snapshot(
        self,
        state_dict: dict[str, Any],
        epoch: int | None = None,
        intermediate_checkpoint: bool = False,
        adapter_only: bool = False,
        **kwargs,
    ) -> dict[str, Any]:
        from torchtune import training  # lazy: torchtune, after set_env() (see train_bpe)

        epoch = kwargs.get("epoch", epoch)
        r = self.recipe
        sched = self.scheduler()
        snap: dict[str, Any] = {
            "epoch": epoch,
            "folder": f"epoch_{epoch}",
            "intermediate": bool(intermediate_checkpoint),
            "adapter_only": bool(adapter_only),
            "keys_handed_to_checkpointer": sorted(state_dict),
            "counters": {
                "global_step": r.global_step,
                "epochs_run": r.epochs_run,
                "total_epochs": r.total_epochs,
                "max_steps_per_epoch": r.max_steps_per_epoch,
                "steps_per_epoch": r._steps_per_epoch,
                "seed": r.seed,
                "optimizer_step": shared_adam_step(self.adam_steps()),
                "scheduler_last_epoch": sched.last_epoch,
                "scheduler_step_count": sched._step_count,
            },
            "lr": {
                "param_groups": self.group_values("lr"),
                "initial_lr": self.group_values("initial_lr"),
                "base_lrs": [float(x) for x in sched.base_lrs],
                "last_lr": [float(x) for x in sched.get_last_lr()],
            },
        }
        if training.MODEL_KEY in state_dict:
            snap["model_keys"] = list(state_dict[training.MODEL_KEY])
        if training.ADAPTER_KEY in state_dict:
            snap["adapter_keys"] = list(state_dict[training.ADAPTER_KEY])
        if training.OPT_KEY in state_dict:
            osd = state_dict[training.OPT_KEY]
            snap["optimizer"] = {
                "param_groups": [{k: param_group_value(v) for k, v in g.items()} for g in osd["param_groups"]],
                "state_ids": sorted(osd["state"]),
                "state_fields": sorted({f for s in osd["state"].values() for f in s}),
            }
        for key in (training.SEED_KEY, training.EPOCHS_KEY, training.TOTAL_EPOCHS_KEY, training.MAX_STEPS_KEY):
            if key in state_dict:
                snap.setdefault("recipe_state", {})[key] = state_dict[key]
        if training.DATALOADER_KEY in state_dict:
            snap.setdefault("recipe_state", {})["dataloader_keys"] = sorted(state_dict[training.DATALOADER_KEY])
        return snap


def _listing(folder: Path, prefix: str) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {f"{prefix}/{p.relative_to(folder)}": p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def run_recipe(sample: str, cfg_file: Path, overrides: list[str], *, stop_after: int | None = None):
    """The body of the recipe's `recipe_main`, with the observers attached between setup and train.
    Returns (cfg, recipe, recorder, stopped_early)."""
    from torchtune import config  # lazy: torchtune, after set_env() (see train_bpe)

    cls = recipe_class(sample)
    cfg = parse_config(cfg_file, overrides)
    config.log_config(recipe_name=cls.__name__, cfg=cfg)
    recipe = cls(cfg=cfg)
    recipe.setup(cfg=cfg)
    rec = Recorder(recipe, stop_after=stop_after)
    stopped = False
    try:
        recipe.train()
    except StopCheck:
        stopped = True
    recipe.cleanup()
    return cfg, recipe, rec, stopped


def write_yaml(cfg: dict[str, Any], path: Path) -> Path:
    from omegaconf import OmegaConf  # lazy: torchtune's dependency, not ckpt's (see train_bpe)

    OmegaConf.save(OmegaConf.create(cfg), path)
    return path


def set_env(work: Path) -> None:
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets_cache")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TIKTOKEN_CACHE_DIR"] = ""


# --- make ------------------------------------------------------------------------------------------------------


def make(sample: str, out: Path) -> None:
    target = (out / sample).resolve()
    if target.exists() and any(target.iterdir()):
        raise SystemExit(f"{target} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt_torchtune_"))
    try:
        set_env(work)
        inputs = write_inputs(work / "inputs")
        cfg_dict = recipe_config(sample, inputs, output_dir=target, log_dir=work / "logs")
        cfg_file = write_yaml(cfg_dict, work / f"{sample}.yaml")
        cfg, recipe, rec, _ = run_recipe(sample, cfg_file, [])
        write_make_manifest(sample, target, cfg, cfg_dict, recipe, rec, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in (
        "torchtune",
        "torchao",
        "torchdata",
        "torch",
        "transformers",
        "safetensors",
        "datasets",
        "tiktoken",
        "omegaconf",
    ):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def hf_names(recipe, sample: str) -> dict[str, str]:
    """torchtune name -> the name the checkpointer saves it under, by torchtune's own converter applied to the live
    model's tensors: convert_weights.tune_to_hf (full model, model-*.safetensors) or tune_to_peft_adapter_weights
    (LoRA adapter, adapter_model.safetensors), as FullModelHFCheckpointer.save_checkpoint runs them."""
    # lazy: torchtune, after set_env() (see train_bpe)
    from torchtune.models import convert_weights
    from torchtune.modules.peft import get_adapter_state_dict

    sd = {k: v.detach().clone() for k, v in recipe._model.state_dict().items()}
    if sample == "torchtune_lora":
        sd = get_adapter_state_dict(sd)
        conv = convert_weights.tune_to_peft_adapter_weights(sd, num_heads=N_HEADS, num_kv_heads=N_KV_HEADS, dim=DIM)
    else:
        conv = convert_weights.tune_to_hf(sd, num_heads=N_HEADS, num_kv_heads=N_KV_HEADS, dim=DIM)
    if len(conv) != len(sd):
        raise RuntimeError("tune_to_hf changed the number of tensors")
    return dict(zip(sd, conv))


def write_make_manifest(sample, target: Path, cfg, cfg_dict, recipe, rec: Recorder, work: Path) -> None:
    from omegaconf import OmegaConf  # lazy: torchtune's dependency, not ckpt's (see train_bpe)

    named = list(recipe._model.named_parameters())
    saved, last = _the_two_saves(rec, len(named))
    trainable = [n for n, p in named if p.requires_grad]
    placeholders = {str(target): "<sample>", str(work): "<temp>"}
    write_manifest(
        target,
        sample=sample,
        format="torchtune",
        world_size=1,
        topology={"dp": 1, "tp": 1, "pp": 1},
        steps=saved["counters"]["global_step"],
        counters=saved["counters"],
        lr=saved["lr"],
        parameters={"count": int(sum(p.numel() for _, p in named)), "tensors": len(named)},
        extra={
            "producer": f"torchtune recipe {RECIPES[sample]} (real; torchtune's FullModelHFCheckpointer wrote the "
            "saves)",
            "recipe_file": f"recipes/{recipe_file(sample).name}",
            "recipe_class": type(recipe).__name__,
            "torchtune_version": versions()["torchtune"],
            "package_versions": versions(),
            "layout": "torchtune",
            "intermediate_save": saved["folder"],
            "final_save": last["folder"],
            "resume_from": _resume_from(sample, saved, cfg_dict),
            "saves": rec.saves,
            "history": rec.history,
            "history_note": HISTORY_NOTE,
            "optimizer_param_names": [n for n, _ in named],
            "optimizer_param_names_note": "the names of the parameters in the order of the optimizer's integer ids "
            "(the recipe builds AdamW from model.parameters(); one param group)",
            "optimizer_state_param_names": [named[i][0] for i in saved["optimizer"]["state_ids"]],
            "trainable_parameter_names": trainable,
            "trainable_parameters": {
                "count": int(sum(p.numel() for _, p in named if p.requires_grad)),
                "tensors": len(trainable),
            },
            "hf_names": hf_names(recipe, sample),
            "hf_names_note": HF_NAMES_NOTE[sample],
            "files": _files_beside_the_saves(target, saved, last),
            "torchtune_config_yaml_note": "torchtune_config.yaml is written by torchtune's DiskLogger.log_config "
            "into cfg.output_dir; its paths name the run's temporary input folder",
            "config": _replace_paths(OmegaConf.to_container(cfg, resolve=True), placeholders),
            "model": _model_description(cfg_dict),
            "tokenizer": f"torchtune llama3_tokenizer on a tiktoken BPE trained here ({len(BASE_BYTES)} bytes + "
            f"{N_MERGES} merges) + {len(SPECIAL_TOKENS)} special tokens at ids "
            f"{VOCAB - len(SPECIAL_TOKENS)}-{VOCAB - 1}; max_seq_len {TOKENIZER_MAX_SEQ_LEN}",
            "dataset": f"torchtune text_completion_dataset(source='json'), {N_EXAMPLES} lines, batch {BATCH}, "
            f"shuffle, {len(recipe._dataloader)} batches per epoch (drop_last)",
            "schedule": {
                "num_training_steps": recipe.total_epochs * recipe._steps_per_epoch,
                "num_warmup_steps": WARMUP,
                "kind": "get_cosine_schedule_with_warmup",
            },
            "scheduler_note": "no scheduler state and no global step are saved; on resume torchtune sets "
            "global_step = epochs_run * steps_per_epoch and builds LambdaLR(last_epoch = "
            "global_step - 1), whose base LR is each param group's saved initial_lr",
            "run_time_changes": RUN_TIME_CHANGES,
            "lora": LORA_DESCRIPTION if sample == "torchtune_lora" else None,
        },
    )


def _the_two_saves(rec: Recorder, n_params: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the intermediate save, the final save) the Recorder saw; the optimizer's integer ids must be the model's
    parameter order."""
    inter = [s for s in rec.saves if s["intermediate"]]
    final = [s for s in rec.saves if not s["intermediate"]]
    if len(inter) != 1 or len(final) != 1:
        raise RuntimeError(f"expected one intermediate and one final save, got {[s['folder'] for s in rec.saves]}")
    saved = inter[0]
    opt_ids = [i for g in saved["optimizer"]["param_groups"] for i in g["params"]]
    if opt_ids != list(range(n_params)):
        raise RuntimeError(f"optimizer ids {opt_ids} are not the model's parameter order 0..{n_params - 1}")
    return saved, final[0]


def _files_beside_the_saves(target: Path, saved: dict[str, Any], last: dict[str, Any]) -> dict[str, int]:
    """Every file in the sample folder (path -> size): the two saves' files and torchtune_config.yaml, nothing else."""
    on_disk = {k[2:]: v for k, v in _listing(target, prefix=".").items()}
    written = {**saved["files_written"], **last["files_written"]}
    extra_files = sorted(set(on_disk) - set(written))
    if extra_files != ["torchtune_config.yaml"]:
        raise RuntimeError(f"unexpected files beside the saves: {extra_files}")
    return on_disk


def _resume_from(sample: str, saved: dict[str, Any], cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """How torchtune 0.6.1 resumes from the intermediate save (the check mode's settings)."""
    folder = saved["folder"]
    if sample == "torchtune_lora":
        return {
            "epoch_folder": folder,
            "recipe_state": "recipe_state/recipe_state.pt",
            "checkpoint_files": list(cfg_dict["checkpointer"]["checkpoint_files"]),
            "how": "torchtune 0.6.1 LoRA: resume_from_checkpoint=True; the base model is read from "
            "checkpointer.checkpoint_dir + checkpoint_files (the ORIGINAL pretrained folder, not in "
            "the sample), adapter_checkpoint = epoch_N/adapter_model.pt (without it torchtune takes "
            "the largest epoch_N, i.e. the final save), recipe_checkpoint = "
            "recipe_state/recipe_state.pt",
            "adapter_checkpoint": f"{folder}/adapter_model.pt",
        }
    model_files = sorted(
        k.split("/", 1)[1]
        for k in saved["files_written"]
        if k.startswith(folder + "/model-") and k.endswith(".safetensors")
    )
    return {
        "epoch_folder": folder,
        "recipe_state": "recipe_state/recipe_state.pt",
        "checkpoint_files": [f"{folder}/{f}" for f in model_files],
        "how": "torchtune 0.6.1: resume_from_checkpoint=True, checkpointer.checkpoint_files = these paths "
        "(relative to the checkpointer's output_dir), recipe_checkpoint = recipe_state/recipe_state.pt",
    }


def _model_description(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    return {
        "builder": cfg_dict["model"]["_component_"],
        "vocab_size": VOCAB,
        "embed_dim": DIM,
        "num_layers": N_LAYERS,
        "num_heads": N_HEADS,
        "num_kv_heads": N_KV_HEADS,
        "intermediate_dim": INTERMEDIATE,
        "max_seq_len": MODEL_MAX_SEQ_LEN,
        "rope_base": ROPE_BASE,
        "hf_input": "transformers LlamaForCausalLM.save_pretrained (seed 0), untied lm_head",
    }


HF_NAMES_NOTE = {
    "torchtune_lora": "torchtune adapter name -> the PEFT name it is saved under in "
    "epoch_N/adapter_model.safetensors (adapter_model.pt keeps the torchtune names); "
    "q_proj lora_b is stored permuted to HF's rotary layout (tune_to_peft_adapter_weights)",
    "torchtune_full": "torchtune name -> the HF name it is saved under in epoch_N/model-*.safetensors; "
    "q_proj/k_proj weights are stored permuted to HF's rotary layout (tune_to_hf)",
}

LORA_DESCRIPTION = {
    "rank": LORA_RANK,
    "alpha": LORA_ALPHA,
    "modules": list(LORA_MODULES),
    "save_adapter_weights_only": True,
    "why_adapter_only": "with save_adapter_weights_only False, torchtune 0.6.1 merges the adapter "
    "in place into the live base weights at each save on CPU ({k: v.cpu()} "
    "does not copy), corrupting the rest of the run",
}


RUN_TIME_CHANGES = [
    "none to torchtune's behaviour: no installed file edited, no torchtune function/class replaced",
    "observers on the live recipe after setup: optimizer register_step_pre_hook/register_step_post_hook; "
    "recipe._metric_logger.log_dict and recipe._checkpointer.save_checkpoint wrapped as instance attributes "
    "(record, then call the original with the same arguments)",
    "environment: HF_DATASETS_CACHE=<temp>, HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, TIKTOKEN_CACHE_DIR='' "
    "(no tiktoken cache in /tmp/data-gym-cache)",
    "recipe loaded with runpy.run_path from torchtune's registry path (as `tune run`); config parsed by "
    "TuneRecipeArgumentParser + _merge_yaml_and_cli_args (as @config.parse); recipe_main's body run step by step",
]


def _replace_paths(obj: Any, placeholders: dict[str, str]) -> Any:
    if isinstance(obj, dict):
        return {k: _replace_paths(v, placeholders) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_paths(v, placeholders) for v in obj]
    if isinstance(obj, str):
        for real, ph in placeholders.items():
            obj = obj.replace(real, ph)
    return obj


# --- check (resume) --------------------------------------------------------------------------------------------


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _locate(path: Path) -> tuple[Path, Path, dict[str, Any] | None]:
    """(sample folder, epoch folder, manifest or None) from a sample folder or one of its epoch_N folders."""
    path = path.resolve()
    if re.fullmatch(r"epoch_\d+", path.name):
        sample_dir, epoch_dir = path.parent, path
    else:
        sample_dir, epoch_dir = path, None
    mpath = sample_dir.with_name(sample_dir.name + ".manifest.json")
    manifest = json.loads(mpath.read_text()) if mpath.is_file() else None
    if epoch_dir is None:
        if manifest is None:
            raise SystemExit(f"{sample_dir}: no manifest beside it; pass the epoch_N folder to resume from")
        epoch_dir = sample_dir / manifest["extra"]["resume_from"]["epoch_folder"]
    if not (sample_dir / "recipe_state" / "recipe_state.pt").is_file():
        raise SystemExit(f"{sample_dir}: no recipe_state/recipe_state.pt (torchtune writes it with intermediate saves)")
    return sample_dir, epoch_dir, manifest


def check(sample: str, path: Path, record: Path | None, steps: int | None, tune_args: list[str]) -> int:
    """Resume the sample in torchtune's own recipe (in a scratch copy: the sample is only read), print each
    resumed step beside the uninterrupted run's, and write what happened to `record`."""
    sample_dir, epoch_dir, manifest = _locate(path)
    before = _digests(sample_dir)
    work = Path(tempfile.mkdtemp(prefix="ckpt_torchtune_check_"))
    try:
        set_env(work)
        inputs = write_inputs(work / "inputs")
        # torchtune 0.6.1 resumes inside the checkpointer's output_dir (model files and recipe state are looked up
        # relative to it, an epoch_N folder must exist in it, and the resumed run saves into it): the output_dir is
        # a scratch copy of the sample folder, so the sample itself is only read
        scratch = work / sample_dir.name
        shutil.copytree(sample_dir, scratch)
        cfg_dict = _resume_config(sample, inputs, scratch, epoch_dir, work)
        cfg_file = write_yaml(cfg_dict, work / f"{sample}_resume.yaml")
        cfg, recipe, rec, stopped = run_recipe(sample, cfg_file, list(tune_args), stop_after=steps)
        original = {h["step"]: h for h in (manifest or {}).get("extra", {}).get("history", [])}
        records, all_same = _compare_with_uninterrupted(rec.history, original)
        if _digests(sample_dir) != before:
            raise RuntimeError("the check changed the sample folder")
        result = {
            "sample": sample,
            "resumed_from": {"epoch_folder": epoch_dir.name, "recipe_state": "recipe_state/recipe_state.pt"},
            "tune_args": list(tune_args),
            "steps_requested": steps,
            "stopped_early": stopped,
            "resumed_state": {
                "epochs_run_loaded": records and records[0]["epoch"],
                "global_step_at_start": recipe.global_step - len(rec.history),
                "num_training_steps": EPOCHS * MAX_STEPS_PER_EPOCH,
            },
            "records": records,
            "matches_uninterrupted": all_same if original else None,
            "scratch_saves": [{k: s[k] for k in ("folder", "intermediate", "files_written")} for s in rec.saves],
            "package_versions": versions(),
        }
        if record is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _resume_config(sample: str, inputs: dict[str, Path], scratch: Path, epoch_dir: Path, work: Path):
    """The run's config with torchtune 0.6.1's resume settings, its output_dir the scratch copy."""
    cfg_dict = recipe_config(sample, inputs, output_dir=scratch, log_dir=work / "logs")
    ck = cfg_dict["checkpointer"]
    ck["recipe_checkpoint"] = "recipe_state/recipe_state.pt"
    if sample == "torchtune_lora":
        # 0.6.1 LoRA resume: base weights from checkpoint_dir (the pretrained folder, rebuilt identically);
        # without adapter_checkpoint torchtune takes the LARGEST epoch folder's adapter (the final save)
        ck["adapter_checkpoint"] = f"{epoch_dir.name}/adapter_model.pt"
    else:
        ck["checkpoint_dir"] = str(epoch_dir)
        ck["checkpoint_files"] = [f"{epoch_dir.name}/{p.name}" for p in sorted(epoch_dir.glob("model-*.safetensors"))]
    cfg_dict["resume_from_checkpoint"] = True
    return cfg_dict


_RECORDED = ("step", "epoch", "lr", "lr_after", "optimizer_step", "loss", "logged_lr", "scheduler_last_epoch")


def _compare_with_uninterrupted(
    history: list[dict[str, Any]], original: dict[int, dict[str, Any]]
) -> tuple[list[dict[str, Any]], bool]:
    """(one record per resumed step, whether every step had the uninterrupted run's LR and loss); each record
    printed, with the uninterrupted step beside it where the manifest has one (loss within 1e-6 relative)."""
    records, all_same = [], True
    for h in history:
        r = {k: h.get(k) for k in _RECORDED}
        o = original.get(h["step"])
        line = f"RESUMED step {r['step']}: lr {r['lr']} loss {r['loss']}"
        if o is not None:
            same_lr = o["lr"] == r["lr"]
            same_loss = o.get("loss") is not None and abs(o["loss"] - r["loss"]) <= 1e-6 * max(1.0, abs(o["loss"]))
            r["uninterrupted"] = {"lr": o["lr"], "loss": o.get("loss"), "same_lr": same_lr, "same_loss": same_loss}
            all_same = all_same and same_lr and same_loss
            line += (
                f" | uninterrupted lr {o['lr']} loss {o.get('loss')} -> "
                f"{'SAME' if same_lr and same_loss else 'DIFFERENT'}"
            )
        print(line, flush=True)
        records.append(r)
    return records, all_same


def main() -> None:
    p = check_mode_parser(
        "Make (or resume-check) the torchtune recipe samples.",
        SAMPLES,
        check_help="a torchtune sample folder (or its epoch_N folder) to resume from",
        steps_default=None,
        steps_help="check mode: steps to train after loading (default: the rest of the schedule)",
    )
    p.add_argument(
        "--tune-arg",
        action="append",
        default=[],
        dest="tune_args",
        help="check mode: a torchtune config override key=value, as on the `tune run` command line (repeatable)",
    )
    args = p.parse_args()
    if (args.out is None) == (args.check is None):
        p.error("give exactly one of --out or --check")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.check is not None:
        code = check(args.sample, args.check, args.record, args.steps, args.tune_args)
    else:
        make(args.sample, args.out)
        code = 0
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
