"""Calls a training job can make into ncclwatch (``ncclwatch.beat(step)``).

Separate from ``watchdog`` so that a worker importing it loads only the
standard library, never the daemon's dependencies.
"""

from launcher.heartbeat import beat

__all__ = ["beat"]
