"""The models, data and training loops the cases share: the plan's building blocks (``blocks``,
``moe``, ``vision``), its networks (``networks``, ``models``) and the training steps that run them
beside their baselines (``training``).

May import ``tests.kit.runtime`` and ``tests.kit.judging``.
"""
