"""pipeline.federation.simulation_poller: the same messages as Flower's poller, without a scan per node."""
from __future__ import annotations

import threading
from queue import Queue
from types import SimpleNamespace

from flwr.server.superlink.fleet.vce import vce_api

from pipeline.federation import simulation_poller as poller


class FakeState:
    """The parts of Flower's InMemoryLinkState the pollers use; get_message_ins behaves like Flower's (scan the
    store, return the node's first undelivered message, mark it delivered) and counts the messages it scans."""

    def __init__(self, destinations: list[int]):
        self.lock = threading.RLock()
        self.message_ins_store = {f"m{i}": SimpleNamespace(id=f"m{i}", metadata=SimpleNamespace(dst_node_id=d, delivered_at=""))
                                  for i, d in enumerate(destinations)}
        self.scanned = 0

    def get_message_ins(self, node_id, limit):
        out = []
        with self.lock:
            for msg in self.message_ins_store.values():
                self.scanned += 1
                if msg.metadata.dst_node_id == node_id and msg.metadata.delivered_at == "":
                    out.append(msg)
                if limit and len(out) == limit:
                    break
        for msg in out:
            msg.metadata.delivered_at = "now"
        return out


class StopAfter(threading.Event):
    """An event that reads as set after ``n`` checks: the pollers' loops run a fixed number of polls."""

    def __init__(self, n: int):
        super().__init__()
        self.left = n

    def is_set(self):
        self.left -= 1
        return self.left < 0

    def wait(self, timeout=None):
        return False


def _run(fn, destinations, nodes, polls):
    state, queue = FakeState(destinations), Queue()
    fn(state, queue, {n: None for n in nodes}, StopAfter(polls))
    return [queue.get().id for _ in range(queue.qsize())], state.scanned


def test_delivers_what_flowers_poller_delivers_in_the_same_number_of_polls():
    # 100 nodes, one message each, plus a second message for node 3 (delivered in the second poll)
    destinations = list(range(100)) + [3]
    nodes = range(100)
    ours, our_scans = _run(poller.add_messages_to_queue, destinations, nodes, polls=2)
    flowers, flower_scans = _run(poller._flower_poller, destinations, nodes, polls=2)
    assert sorted(ours) == sorted(flowers) == sorted(f"m{i}" for i in range(101))
    # Flower asks for every node in every poll, scanning the store each time: 2 polls x 100 nodes; ours asks only
    # for nodes with a message waiting (100 in the first poll, 1 in the second)
    assert flower_scans > 100 * 100
    assert our_scans < flower_scans / 1.9


def test_an_idle_poll_scans_nothing_per_node():
    state, queue = FakeState(list(range(50))), Queue()
    assert poller.poll_once(state, queue, range(50)) == 50
    before = state.scanned
    assert poller.poll_once(state, queue, range(50)) == 0  # everything delivered: no get_message_ins at all
    assert state.scanned == before


def test_messages_for_nodes_outside_the_mapping_stay_in_the_store():
    state, queue = FakeState([0, 1, 7]), Queue()
    assert poller.poll_once(state, queue, [0, 1]) == 2
    assert state.message_ins_store["m2"].metadata.delivered_at == ""


def test_installed_only_inside_the_block():
    assert vce_api.add_messages_to_queue is poller._flower_poller
    with poller.linear_polling():
        assert vce_api.add_messages_to_queue is poller.add_messages_to_queue
    assert vce_api.add_messages_to_queue is poller._flower_poller
