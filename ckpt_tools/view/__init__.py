"""One checkpoint, whatever its format: opened and accounted for (`checkpoint.open_checkpoint`, `accounting`:
what was read against what the checkpoint declares), and its logical tensors by parameter name (`logical`)."""
