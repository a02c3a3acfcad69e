"""Consort engine: a paged-KV continuous-batching LLM engine (one per specialist)."""
