"""Where alerts go: the sink contract shared by PagerDuty, Slack and the generic webhook.

A sink has a ``name`` (also its spool folder) and ``async send(alert) -> Delivery``; one whose class sets
``each_node = True`` (the upload) is delivered by every node for itself, not only by the node that pages.
It never raises: every outcome is a ``Delivery``, and the dispatcher
(``delivery.Dispatcher``) alone decides what happens next::

    Delivery
    ├── ok=True                 accepted (PagerDuty 202, Slack 200, webhook 2xx): spool file removed
    ├── ok=False, retry=True    429, 408, 5xx, connection refused, timeout: sent again with backoff,
    │                           after ``retry_after_s`` when the receiver said how long (Retry-After)
    └── ok=False, retry=False   any other answer (400, 403, 404, an unexpected 2xx/3xx): permanent,
                                moved to ``<spool>/failed/`` with ``detail`` and logged

``detail`` is for people and logs: the status and the start of the receiver's
answer, never a routing key or a secret URL.  ``said``: the one line the
terminal gets about a final outcome, where the user needs it (an upload: the
incident's address, or why the bundle did not go up); other outcomes are logged.
``expected``: a retry that is how the sink works (the bundle follows its page),
logged only with -v; any other retry is logged once for each new reason.

Kept import-light (no aiohttp, no metrics): the daemon and the metrics module
import this for the types alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ncclwatch.watchdog.sinks.alert import Alert


@dataclass(frozen=True)
class Delivery:
    ok: bool
    retry: bool
    detail: str
    retry_after_s: float | None = None  # the receiver's Retry-After, when it sent one
    said: str | None = None  # the terminal's line for this final outcome (see the module's docstring)
    expected: bool = False  # a retry the sink expects (see the module's docstring)


class Sink(Protocol):
    name: str

    async def send(self, alert: Alert) -> Delivery:
        """Deliver one alert once; never raises."""
        ...
