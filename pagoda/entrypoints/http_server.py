"""uvicorn's server with pagoda's way of stopping, for `pagoda serve` and `pagoda
router` alike (torch-free: the router's process never loads torch)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

logger = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """uvicorn's server, with pagoda's stops:

    - the first SIGTERM/SIGINT refuses new requests and aborts what is still running
      after `shutdown_timeout` seconds; uvicorn then closes what is left
      (`timeout_graceful_shutdown`), and the process exits 0 instead of re-raising
      the signal;
    - an engine that dies makes the server stop with exit code 1 (`engine_died`).
    """

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.engine = None  # an AsyncEngine (pagoda serve), or none (pagoda router)
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0

    def engine_died(self, error: BaseException) -> None:  # from the engine thread
        logger.error("pagoda serve: the engine died (%s); exiting with status 1", error)
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.engine is not None:
            logger.info(
                "pagoda serve: stopping; in-flight requests have %.0f s to finish",
                self.shutdown_timeout,
            )
            self.engine.stop_accepting()
            timer = threading.Timer(self.shutdown_timeout, self.engine.abort_all)
            timer.daemon = True
            timer.start()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
