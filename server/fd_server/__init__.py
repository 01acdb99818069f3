"""fd_server: the OpenAI-compatible HTTP service of ``fd serve``, on top of the engine client.

Packaged inside the fd-core distribution. ``build_app`` (``fd_server.app``) makes the FastAPI
app for an engine client; ``serve`` (``fd_server.launch``) starts the engine-core process and
runs the app under uvicorn; ``python -m fd_server`` is ``fd serve``.
"""
