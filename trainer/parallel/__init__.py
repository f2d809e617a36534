"""More than one process: collectives inside named phases, FSDP and DeepSpeed, the N-D mesh (HSDP, tensor
parallel) and context parallelism."""
