"""A real trainer as a judge: torchtitan trains on torch FSDP2 and on any implementation, compared step by step."""
