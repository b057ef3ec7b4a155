"""`ckpt resume`: the plan (`deepspeed` for DeepSpeed's engine, `frameworks` for HF Trainer, Accelerate, DCP /
FSDP2, Lightning and Megatron-LM), the verdict it gives (`verdict`), and the processes that run the framework
(`workers`: one per framework, started under torchrun by `train.processes.launch`)."""
