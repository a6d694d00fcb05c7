"""The API layer: ``fully_shard``, ``HSDPModule``, policies and argument checks."""
