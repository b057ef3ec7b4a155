"""`ckpt resume`: `frameworks` is the one entry (`plan_resume`, `run_resume`) and chooses the framework's planner —
`deepspeed` (run and judged by `deepspeed_run`), `hf_trainer`, `accelerate`, `dcp`, `lightning`, `megatron` (run
and judged by `framework_run`; shared parts in `common`, torch schedules in `torch_schedules`); `verdict` holds
what every verdict is made of; `workers`: one process per framework, started under torchrun by
`train.processes.launch`."""
