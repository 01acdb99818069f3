"""fd-backend-gcu: fd's Enflame GCU (S60) backend on the Paddle runtime.

``fd_backend_gcu.platform`` holds the platform (detection, capabilities); memory, collectives
and emulation are ``fd_core.runtimes.paddle.device``'s, the fused-kernel adapters
``fd_core.runtimes.paddle.fused``'s. Run without the chip: ``FD_EMULATE=gcu``.
"""
