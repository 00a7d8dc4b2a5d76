"""Tests start real servers through the package's in-process runner."""

from ds4serve.server.inprocess import RunningServer, free_port, serve  # noqa: F401
