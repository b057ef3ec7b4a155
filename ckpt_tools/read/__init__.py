"""Reading, without executing anything: torch pickles and zips parsed inert (`pickle_reader`), the few real
objects loaded through an allowlist (`safe_load`), object storage by ranged requests (`remote`), the one tree every
format becomes (`tree`), where its training state lives (`state`), how TP shards and fused projections form a
parameter (`tp_layout`, `qkv`), and one tensor's bytes (`tensor_read`). Imports nothing above it but `errors`."""
