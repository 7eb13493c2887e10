"""ncclwatch: find the rank at fault when a distributed PyTorch job hangs.

Everything installs under this one name: ``ncclwatch.watchdog`` (the sidecar
and the engine, from the repository's ``watchdog/``) and
``ncclwatch.launcher`` (the torchrun wrapper and what it injects, from
``launcher/``).  This module itself is what a training job may call
(``ncclwatch.beat(step)``): importing it loads only the standard library,
never the daemon's dependencies.
"""

from ncclwatch.launcher.heartbeat import beat

__all__ = ["beat"]
