"""Test/benchmark helpers: a real SGLang CPU server, SGLang's router, long multi-turn sessions."""
