"""``fully_shard`` API (``api``) and policies (``utils``).

Kept empty on purpose: the mechanics under ``platform/torch`` import ``utils`` (the policies), and
importing this package must not pull ``api`` in, which imports the mechanics (no import circle).
"""
