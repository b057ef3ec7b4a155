"""Tiny real models and training loops: they make the sample checkpoints and drive `ckpt resume`.

Everything here runs the real frameworks (DeepSpeed, torch FSDP/DCP, Accelerate) on CPU with gloo.
It is imported only by the sample maker, the resume command and the tests, never by `inspect`.
"""
