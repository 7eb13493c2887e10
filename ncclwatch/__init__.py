"""ncclwatch: find the rank at fault when a distributed PyTorch job hangs.

Everything installs under this one name: ``ncclwatch.watchdog`` (the sidecar
and the engine, from the repository's ``watchdog/``) and
``ncclwatch.launcher`` (the torchrun wrapper and what it injects, from
``launcher/``).  This module itself is what a training job may call
(``ncclwatch.beat(step)``): importing it loads only the standard library,
never the daemon's dependencies.
"""

import os as _os

# In a source checkout the subpackages stand beside this folder (../watchdog, ../launcher);
# an install puts them inside it.  Without this, `python -m ncclwatch` run from a clone's
# root would find this folder first and none of the subpackages.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "launcher", "inject", "sitecustomize.py")):  # ours, not PyPI's `watchdog`
    __path__.append(_checkout)

from ncclwatch.launcher.heartbeat import beat  # noqa: E402

__all__ = ["beat"]
