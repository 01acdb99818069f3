"""Benchmarks that ship with fd; ``fd bench serve`` loads an OpenAI-compatible server over HTTP."""
