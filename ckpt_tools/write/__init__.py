"""Writing: the one plan -> dry run -> execute -> verify path (`io`), and every writer it runs — torch pickles and
zips (`pickle_writer`, `torch_zip`, `zip_patch`), DCP folders (`dcp_write`), Megatron-LM run folders
(`megatron_write`)."""
