"""fd-backend-dcu: fd's Hygon DCU (K100AI) backend on the Paddle runtime.

``fd_backend_dcu.platform`` holds the platform (detection, capabilities); memory, collectives
and emulation are ``fd_core.runtimes.paddle.device``'s, the fused-kernel adapters
``fd_core.runtimes.paddle.fused``'s. Run without the chip: ``FD_EMULATE=dcu``.
"""
