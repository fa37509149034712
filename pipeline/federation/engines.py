"""The engine that runs the ServerApp and the ClientApps inside the `train` stage: :class:`InProcessGrid`."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from pipeline.experiments.settings import RunSettings
from pipeline.federation.client_app import client_app, errors_stay_on_the_client
from pipeline.federation.protocol import load_plan
from pipeline.federation.server_app import load_server_checkpoint, run_server
from pipeline.training.client_data import client_names
from pipeline.training.history import TrainRecorder
from pipeline.training.set_engine import park


class InProcessGrid(Grid):
    """Flower's Grid, delivering each Message to ``client_app`` in this process, one node after the other (in a set:
    at the set's round barrier, with the other runs' clients). Each node keeps its own Context across rounds, as a
    SuperNode does; messages are copied both ways (client and server share no object a change could reach, see
    :func:`_copy`); a ClientApp's exception becomes the deployed ClientApp's reply (errors_stay_on_the_client)."""

    def __init__(self, client_app: ClientApp, node_configs: list[dict[str, Any]]):
        self.client_app, self._run = client_app, Run.create_empty(1)
        self.contexts = {
            node: Context(run_id=1, node_id=node, node_config=dict(config), state=RecordDict(), run_config={})
            for node, config in enumerate(node_configs, start=1000)
        }
        self._pending: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        for msg in (messages := list(messages)):
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self._pending[msg.metadata.message_id] = _copy(msg)
        return [msg.metadata.message_id for msg in messages]

    def deliver(self, msg: Message) -> Message:
        """The reply of ``msg``'s node (a copy)."""
        return _copy(errors_stay_on_the_client(msg, self.contexts[msg.metadata.dst_node_id], self.client_app))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        messages = [self._pending.pop(mid) for mid in message_ids]
        return park(self.deliver, messages)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(list(self.push_messages(messages)))


def _copy(msg: Message) -> Message:
    """A deep copy of ``msg`` but for its Arrays, which both sides share: an Array holds its values as bytes, which
    never change, and no one here sets an Array's fields (records, metadata and configs are the receiver's own)."""
    arrays = [a for record in msg.content.array_records.values() for a in record.values()] if msg.has_content() else []
    return copy.deepcopy(msg, {id(a): a for a in arrays})


def _set_server_identity(run_id: int) -> None:
    # Flower's runtimes set the identity of the process running the ServerApp; Message() reads it.
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID


def run_federated(plan_path: str, settings: RunSettings, recorder: TrainRecorder) -> list[dict[str, Any]]:
    """Run the experiment's ServerApp and ClientApps in this process (in a set, its clients at the set's round
    barrier: set_engine.park); returns the history (the global adapter is in the server checkpoint)."""
    plan = load_plan(plan_path)
    grid = InProcessGrid(client_app, [{"client-name": n, "plan": plan_path} for n in client_names(plan)])
    _set_server_identity(grid.run.run_id)
    ckpt = load_server_checkpoint(plan)  # where the run resumes (None: round 1)
    return run_server(
        grid, plan_path, recorder, settings.round_timeout_s, settings.admission_timeout_s, settings.cache, ckpt=ckpt
    )[1]
