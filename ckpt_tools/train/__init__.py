"""Tiny real models and what runs them: the models and data the samples and resumes share (`models`, `megatron`,
`data`, `manifest`), the stand-in replica and its closed-form optimizer maths (`replica`), and the processes
(`processes`: launch under torchrun, stop; `procgroup`: leave a gloo group cleanly).

Everything here runs the real frameworks (DeepSpeed, torch FSDP/DCP, Accelerate) on CPU with gloo.
It is imported only by the sample maker, the resume command, convert's scheduler mapping and the tests, never by
`inspect`.
"""
