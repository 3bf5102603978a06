"""Structured logging for every hybridrec process (structlog).

JSON lines when stderr is not a terminal (what containers and `hybridrec run`
collect), readable console lines on one. Each service binds its name and
replica once, so every line says where it came from.
"""
from __future__ import annotations

import logging
import os
import sys
from datetime import datetime

import structlog


def setup(*, service: str | None = None, replica: int | None = None, json: bool | None = None,
          level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to service/replica."""
    if json is None:
        json = not sys.stderr.isatty() or os.environ.get("HYBRIDREC_LOG_JSON") == "1"
    level_no = logging.getLevelName((level or os.environ.get("HYBRIDREC_LOG_LEVEL", "INFO")).upper())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no if isinstance(level_no, int) else 20),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    context = {k: v for k, v in (("service", service), ("replica", replica)) if v is not None}
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    return structlog.get_logger()


def get(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name) if name else structlog.get_logger()


def timestamp_of(record: dict) -> float:
    """Unix time of a JSON log line (`setup`'s ISO timestamp in UTC), as read back by the launcher and the
    benchmarks."""
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
