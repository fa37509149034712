"""A linear-time message poller for Flower 1.41's simulation runtime (the Ray engine).

Flower's ``vce_api.add_messages_to_queue`` asks the LinkState for each simulated node's next message every 0.1 s,
and each ask scans every stored message (validating each against the federation): N nodes x M messages per poll,
all round long. With 100 clients that thread alone burned most of a core of this 2-core machine and made the Ray
engine's time per round grow faster than linearly in the number of clients (reports/bench/scale.json, profiled to
~1.2 M message checks per run). This poller first finds, in one pass over the store, which nodes have a message
not yet delivered, and asks for those nodes only; every message still goes through Flower's own
``get_message_ins`` (delivery marking, expiry and federation checks), so what reaches the queue is the same.

It is installed only around a simulation fedmeet starts on the Ray engine (``train.engine: ray``, not the default:
the default in-process engine never reaches Flower's simulation runtime), only for Flower's in-memory LinkState,
whose store it reads (any other state gets Flower's own poller), and only while Flower's poller and its caller
are the code it was written against (:data:`UPSTREAM`; otherwise Flower's own poller runs, with a warning).
Flower 1.41 offers no supported way to replace the poller: ``run_api`` looks it up as a module global.
tests/test_flower_overrides.py fails when either upstream function changes, so that a maintainer re-checks this.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import threading
from queue import Queue
from typing import Any, Iterator

from flwr.server.superlink.fleet.vce import vce_api

_flower_poller = vce_api.add_messages_to_queue
POLL_INTERVAL_S = 0.1  # Flower's own interval
log = logging.getLogger("fedmeet.federated")

# sha256 (first 16 hex digits) of the source of the functions this module stands in for, in flwr 1.41: the poller
# it replaces and the caller that looks it up by name. A change upstream turns the replacement off (see above).
UPSTREAM = {"add_messages_to_queue": "953f4bd41a931a77", "run_api": "f85c0cd6e902752f"}


def source_digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def upstream_matches() -> bool:
    """Whether Flower's poller and its caller are still the code :data:`UPSTREAM` recorded."""
    return all(source_digest(getattr(vce_api, name)) == digest for name, digest in UPSTREAM.items())


def nodes_with_pending_messages(state: Any) -> set[int]:
    """Destination nodes of the stored messages not delivered yet (one pass over the store, under its lock)."""
    with state.lock:
        return {m.metadata.dst_node_id for m in state.message_ins_store.values() if m.metadata.delivered_at == ""}


def poll_once(state: Any, queue: Queue, node_ids) -> int:
    """Move each pending node's next message to the queue, as one round of Flower's loop would; returns the count."""
    moved = 0
    for node_id in sorted(nodes_with_pending_messages(state) & set(node_ids)):
        for msg in state.get_message_ins(node_id=node_id, limit=1):
            queue.put(msg)
            moved += 1
    return moved


def add_messages_to_queue(state: Any, queue: Queue, nodes_mapping, f_stop: threading.Event) -> None:
    """Drop-in for ``vce_api.add_messages_to_queue`` (same arguments, same loop, same interval)."""
    if not (hasattr(state, "message_ins_store") and hasattr(state, "lock")):
        _flower_poller(state, queue, nodes_mapping, f_stop)
        return
    while not f_stop.is_set():
        poll_once(state, queue, nodes_mapping.keys())
        f_stop.wait(POLL_INTERVAL_S)


@contextlib.contextmanager
def linear_polling() -> Iterator[None]:
    """Use this module's poller for the simulations started inside the block (restored afterwards), as long as
    Flower's code is the one it was written against."""
    if not upstream_matches():
        log.warning("flwr's vce_api poller changed since fedmeet's linear poller was written: using Flower's own "
                    "(pipeline/federation/simulation_poller.py, UPSTREAM)")
        yield
        return
    previous = vce_api.add_messages_to_queue
    vce_api.add_messages_to_queue = add_messages_to_queue
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = previous
