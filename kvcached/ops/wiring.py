"""The public CacheManager: the core manager plus the services of an engine process.

:class:`kvcached.core.manager.CacheManager` manages the cache and nothing
else. The process that runs an engine also wants, as its config asks: the
engine's log file under ``log_dir``, the control socket ``kvcached ctl``
talks to, a Prometheus endpoint and a KV event publisher. This subclass
starts them after the core has started and stops them before it closes, so
no control request reaches a manager that is closing.
"""

from __future__ import annotations

from pathlib import Path

from kvcached.config import CacheConfig
from kvcached.core import manager as core_manager
from kvcached.ops.logs import setup_process_logging, stop_process_logging
from kvcached.transfer.base import Transfer


class CacheManager(core_manager.CacheManager):
    """The manager with the services its config turns on (DESIGN.md §9 and §10)."""

    def __init__(self, cfg: CacheConfig, transfer: Transfer | None = None):
        super().__init__(cfg, transfer)
        self._log_file: Path | None = None
        self._services: list = []  # control server, metrics server, event publisher
        self.metrics = None  # the MetricsServer when metrics_port is set

    def start(self) -> CacheManager:
        """Start the core (every rank ready), then the configured services."""
        if self._started:
            return self
        self._log_file = setup_process_logging(self.log_dir, "engine", errors_to_stderr=True)
        try:
            super().start()
        except BaseException:
            self._stop_logging()
            raise
        try:
            self._start_services()
        except BaseException:
            self.close()
            raise
        return self

    def _start_services(self) -> None:
        """The control socket, metrics and KV events, as configured. Imported
        only when configured: they need pyzmq (and prometheus-client), which a
        machine running only the copy path (the GPU check) may lack."""
        cfg = self.cfg
        if cfg.control_socket:
            from kvcached.ops.ctlserver import ControlServer
            self._services.append(ControlServer(self).start())
        if cfg.metrics_port:
            from kvcached.ops.metrics import MetricsServer
            self.metrics = MetricsServer(self, cfg.metrics_host, cfg.metrics_port).start()
            self._services.append(self.metrics)
        if cfg.kv_events_endpoint:
            from kvcached.ops.events import KVEventPublisher
            events = KVEventPublisher(cfg.kv_events_endpoint, source=str(self.run_dir)).start()
            self._services.append(events)
            self.set_event_sink(events)

    def close(self) -> None:
        """Stop the services first (no control request while closing), then the core."""
        if self._closed:
            return
        for service in reversed(self._services):
            service.close()
        self._services.clear()
        self._events = None
        try:
            super().close()
        finally:
            self._stop_logging()

    def _stop_logging(self) -> None:
        if self._log_file is not None:
            stop_process_logging(self._log_file)
            self._log_file = None
