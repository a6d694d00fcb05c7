"""Developer tools of the repository (not part of the ``hyper_parallel`` package nor of the kit)."""
