"""The sweep, the main job (``python -m tests.kit.sweep``): every case of every level through
papermill on one warm cluster per implementation, the executed notebooks and their pages kept as
evidence, an index page over them.

A front end, the kit's top layer: it may import every other layer of the kit. ``run`` (the command),
``execute`` (one notebook on a pooled kernel), ``kernel_fork`` (kernels forked from a warm parent),
``l4`` (the L4 notebook's run and section), ``index`` (the index page).
"""
