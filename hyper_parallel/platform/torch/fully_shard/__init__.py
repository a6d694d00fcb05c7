"""fully_shard mechanics: one concept per file (mesh_info, param, collectives, param_group, state)."""
