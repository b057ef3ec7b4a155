"""Learning-rate schedules as formulas, from what a checkpoint saves: DeepSpeed's (`deepspeed`) and Megatron-LM's
OptimizerParamScheduler (`megatron`). Pure Python; they import nothing."""
