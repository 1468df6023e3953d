"""Test/benchmark helpers: a real SGLang CPU server, an offline Engine, and an HF reference."""
