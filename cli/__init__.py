"""The `ckpt` command line: a thin typer app over `ckpt_tools`."""
