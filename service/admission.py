"""Request admission, one object for both engines: what may come in, what is in flight, and drain.

Every inference request passes `enter()` before it runs and `leave()` once its last byte is sent
(or its client has gone), whichever engine serves it. Two kinds of refusal, kept apart:
- a request that no wait could ever admit (more sequences than one request may make) is the
  client's error: `RequestTooLargeError`, a 400 naming the field;
- a request that a busy or stopping server cannot take now: `QueueFullError` or `ShuttingDown`, a
  503 with Retry-After, which a retry can get past.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from service.engine.base import EngineError, RequestTooLargeError

log = logging.getLogger(__name__)


class QueueFullError(EngineError):
    """Too many requests are in flight already: 503 with Retry-After."""


class ShuttingDown(EngineError):
    """The server drains after SIGTERM and takes no new request: 503 with Retry-After."""


@dataclass
class Admission:
    max_num_seqs: int  # sequences the engine decodes together
    max_queue: int  # requests in flight beyond those, waiting, before new ones get 503
    max_seqs_per_request: int  # prompts x n that one request may make
    in_flight: int = 0  # requests entered and not yet left (streams until their last byte)
    draining: bool = False

    @property
    def max_in_flight(self) -> int:
        return self.max_num_seqs + self.max_queue

    def check_size(self, prompts: int, n: int, together: bool = True) -> None:
        """400 for a request larger than any wait could admit (a retry would fail the same way).
        `together`: the engine runs a request's n choices at once (the torch engine), so n is bounded
        by NIM_MAX_NUM_SEQS too; vLLM runs them as they fit."""
        if together and n > self.max_num_seqs:
            raise RequestTooLargeError(f"n must be at most {self.max_num_seqs} (NIM_MAX_NUM_SEQS)", "n")
        if prompts * n > self.max_seqs_per_request:
            raise RequestTooLargeError(
                f"{prompts} prompt(s) x n={n} make {prompts * n} sequences; one request may make at most "
                f"{self.max_seqs_per_request} (NIM_MAX_SEQS_PER_REQUEST)", "prompt" if prompts > 1 else "n")

    def check_open(self) -> None:
        """503 once the server drains after SIGTERM."""
        if self.draining:
            raise ShuttingDown("the server is shutting down")

    def enter(self, bounded: bool = True) -> None:
        """Count a request in flight, or refuse it (503). `bounded=False`: a request that generates
        nothing (an engine's /tokenize) is counted for drain but never refused for a full queue."""
        self.check_open()
        if bounded and self.in_flight >= self.max_in_flight:
            raise QueueFullError(f"{self.in_flight} requests in flight already (NIM_MAX_NUM_SEQS={self.max_num_seqs} "
                                 f"running + NIM_MAX_QUEUE={self.max_queue} waiting)")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


def drain_then_stop(server: Any, admission: Admission, grace_s: float, signal_name: str) -> None:
    """SIGTERM (or SIGINT) to a uvicorn server, ours or vLLM's: readiness turns 503 and new requests are
    refused while those in flight finish, for up to `grace_s`; then the server stops (exit 0). A
    second signal stops it at once."""
    if admission.draining:
        server.should_exit = server.force_exit = True
        return
    admission.draining = True
    log.info("received %s: draining for up to %ss", signal_name, grace_s)

    def drain() -> None:
        deadline = time.monotonic() + grace_s
        while admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("drained; %d request(s) still in flight", admission.in_flight)
        server.should_exit = True
        if admission.in_flight:
            server.force_exit = True  # uvicorn would otherwise wait for them without end

    threading.Thread(target=drain, name="drain", daemon=True).start()
