"""Started by every Python process of a peer-suite run (pytest and the ranks it spawns): swap torch
FSDP2's public names for the implementation's before any test file imports them, and let
``FSDPTest``'s ranks run on the CPU."""

import os

if os.environ.get("HPKIT_PEER_SPEC") is not None:
    from tools.peer_suite.swap import install

    install(os.environ["HPKIT_PEER_SPEC"])
if os.environ.get("HPKIT_PEER_WORLD"):
    from tools.peer_suite.harness import patch_fsdp_test_for_cpu

    patch_fsdp_test_for_cpu(int(os.environ["HPKIT_PEER_WORLD"]))
