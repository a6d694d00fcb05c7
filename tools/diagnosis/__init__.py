"""The diagnosis measured: no false alarm over the precision cases, and accuracy on the mutants
(docs/diagnosis.md). ``python -m tools.diagnosis --help``."""
