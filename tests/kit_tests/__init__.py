"""The kit's own tests (``tests/kit``'s modules are the kit; these test it), with the rank-side
helpers they run (``_ranks_*``) and the KIT fault cases (``_test_kit_faults``)."""
