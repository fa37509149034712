"""Admission: the server asks every node that connects for its client name; a node naming a client outside the plan
is refused, a declared client missing after the admission timeout fails the run, and a restarted SuperNode takes its
client's place (the ServerApp's round loop, server_app.py, calls these before and during its rounds)."""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from pipeline.federation import protocol

log = logging.getLogger("fedmeet.federated")


class AdmissionError(RuntimeError):
    """The federation the plan declares did not assemble: a declared client never joined, or one cannot train."""


def identify_clients(
    grid: Grid,
    plan_path: str,
    expected: list[str],
    timeout: float,
    sizes: dict[str, dict[str, int]] | None = None,
    start_over: bool = False,
) -> dict[int, str]:
    """Admission: ask every node that connects for its client name until each client of ``expected`` has its node
    (nodes register asynchronously); ``sizes`` receives each client's ``num-train`` / ``num-valid``; ``start_over``:
    the run starts at round 1, each node is told so (protocol.START_OVER)."""
    deadline = time.monotonic() + timeout
    names: dict[int, str] = {}
    refused: dict[int, str] = {}
    while True:
        # a refused node is asked again each poll: with --auth, restarted with its client name fixed, it keeps its id
        if new := [n for n in grid.get_node_ids() if n not in names]:
            refused = {n: c for n, c in refused.items() if n not in new} | name_nodes(
                grid, plan_path, names, new, expected, timeout, sizes, True, start_over, refused
            )
        if not (missing := [c for c in expected if c not in names.values()]):
            for c in expected if sizes is not None else []:
                if lacks := [k for k in ("num-train", "num-valid") if k not in sizes.get(c, {})]:
                    why = f"answered without {' and '.join(lacks)} (its site's partition lacks it: it cannot train)"
                    raise AdmissionError(f"{plan_path}: client {c!r} {why}; refused")
            if empty := [c for c in expected if sizes is not None and sizes.get(c, {}).get("num-valid") == 0]:
                raise AdmissionError(
                    f"{plan_path}: client {empty[0]!r} has no valid examples (no best round, no score); refused"
                )
            return names
        if time.monotonic() > deadline:
            strangers = f"; refused nodes naming {sorted(set(refused.values()))}" if refused else ""
            raise AdmissionError(
                f"{plan_path}: client(s) {missing} never joined within {timeout:.0f}s (admission timeout){strangers}"
            )
        log.info("waiting for clients: %d of %d connected", len(names), len(expected))
        time.sleep(1.0)


def name_nodes(
    grid: Grid,
    plan_path: str,
    node_names: dict[int, str],
    new: list[int],
    allowed: list[str],
    timeout: float,
    sizes: dict[str, dict[str, int]] | None = None,
    admission: bool = False,
    start_over: bool = False,
    refused_before: dict[int, str] | None = None,
) -> dict[int, str]:
    """Ask the ``new`` nodes their client names into ``node_names`` (a restarted SuperNode replaces its old id, a
    second node claiming a client whose node still answers is refused); returns the nodes naming a client outside
    ``allowed`` or serving another plan (logged unless ``refused_before`` holds the same refusal)."""
    refused: dict[int, str] = {}
    for node, (name, ours) in sorted(_names(grid, plan_path, new, timeout, admission, start_over, sizes).items()):
        if not ours or name not in allowed:
            refused[node] = name
            why = f"node {node} names client {name!r}, which is not among the clients {allowed} of plan {plan_path}"
            why = f"node {node} (client {name!r}) serves another plan than {plan_path}" if not ours else why
            if (refused_before or {}).get(node) != name:
                level = logging.ERROR if admission else logging.WARNING
                log.log(level, "%s; %s", why, "refused" if admission else "left out")
            continue
        holder = next((o for o, c in node_names.items() if c == name), None)
        # a holder still listed may be its SuperNode crashed and restarted (without --auth: a new node id) before the
        # SuperLink marks it offline (then answering for it, NODE_UNAVAILABLE): it keeps its client while it answers
        listed = holder is not None and holder in grid.get_node_ids()
        if listed and _names(grid, plan_path, [holder], timeout, admission, start_over) == {holder: (name, True)}:
            why = f"two nodes claim the same client name {name!r}: node {holder}, which holds it, and node {node}"
            if admission:
                raise RuntimeError(f"{why} (plan {plan_path})")
            log.warning("%s; node %d left out", why, node)
            continue
        node_names.pop(holder, None)  # its SuperNode restarted
        node_names[node] = name
        if not admission:
            log.info("client %s (re)joined as node %d", name, node)
    return refused


def _names(grid, plan_path, ids, timeout, admission, start_over, sizes=None) -> dict[int, tuple[str, bool]]:
    """The client names the nodes ``ids`` answer query.identify with, each with whether the node serves ``plan_path``
    (by its hash; ``sizes`` receives such a client's ``num-train`` / ``num-valid``); a node gone offline is left out
    (its client may come back before the timeout)."""
    ours = protocol.load_plan(plan_path).hash  # with start_over: the plan whose nodes start over (a path may differ)
    config = {"plan": plan_path, protocol.START_OVER: start_over, protocol.PLAN_HASH: ours}
    msgs = [
        Message(RecordDict({protocol.CONFIG_KEY: ConfigRecord(config)}), dst_node_id=n, message_type=protocol.IDENTIFY)
        for n in ids
    ]
    named: dict[int, tuple[str, bool]] = {}
    for node, reply in protocol.replies_by_node(grid, msgs, timeout).items():  # a SuperLink answers for an offline node
        identity = None if reply.has_error() else reply.content.config_records.get("identity")
        try:  # a reply that cannot be read is a node failing to identify: a deployed client must not end the run
            name = str(identity["client-name"])  # no identity record (None): TypeError
            spec = {k: (k, *protocol.COUNT) for k in ("num-train", "num-valid") if k in identity}
            counts = protocol.metrics_row(identity, spec, "identity's counts")
        except (KeyError, TypeError, ValueError) as e:
            why = f"its reply has no identity ConfigRecord of a client-name (whole num-train, num-valid): {e!r}"
            why = protocol.error_line(reply) if reply.has_error() else why
            if admission and not (reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE):
                raise RuntimeError(f"node {node} failed to identify: {why}") from None
            log.warning("node %d connected but failed to identify; left out: %s", node, why)
            continue
        named[node] = (name, identity.get(protocol.PLAN_HASH) == ours)
        if sizes is not None and named[node][1]:  # it serves our plan
            sizes[name] = counts
    return named


def connected_nodes(
    grid: Grid, plan_path: str, node_names: dict[int, str], timeout: float, clients: list[str] | None = None
) -> dict[int, str]:
    """The known clients connected now (a new node id, a restarted SuperNode, takes its client's place; a node the
    server forgot, one answering as another client, is asked again); ``clients``: the run's, else ``node_names``'."""
    current = set(grid.get_node_ids())
    if new := sorted(current - set(node_names)):
        name_nodes(grid, plan_path, node_names, new, clients or sorted(set(node_names.values())), timeout)
    return {n: c for n, c in node_names.items() if n in current}
