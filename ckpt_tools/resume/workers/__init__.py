"""Resume workers for checkpoints of frameworks other than DeepSpeed: one module per framework.

Each runs under `python -m torch.distributed.run` (gloo on CPU, NCCL on CUDA), loads the checkpoint with the
framework's own loader, trains a few steps and prints `CKPT_RESUME {json}` events that
`ckpt_tools.resume.frameworks` judges. See `_common` for the event protocol and the closed-form
optimizer check.
"""
