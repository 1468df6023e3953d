"""Helpers only the tests use (not part of the package): children with a tagged JSON result,
the no-cache reference server, storms and sessions drivers, the offline Engine and HF references."""
