"""sglang-sparse: sparse recurrent-state prefix caching for hybrid LLMs."""
