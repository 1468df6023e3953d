"""Helpers only the tests use (not part of the package): children with a tagged JSON result,
the no-cache reference server, the storm driver, the tiny engine that drives the mirror, the
offline Engine and HF references (the sessions driver stays in the package: benchmarks use it)."""
