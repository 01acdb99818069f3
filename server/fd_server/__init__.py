"""fd_server: the OpenAI-compatible HTTP service on top of the fd engine client.

Packaged inside the fd-core distribution. Not implemented yet: the HTTP process, the engine-core
process and ``fd serve`` are the subject of the next milestone; until then this package holds
nothing but its place in the layout.
"""
