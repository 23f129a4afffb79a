"""Replies bound to the requests they answer, on the server side (docs/security.md).

A reply counts only as the answer to a message of the batch just sent, named by its
``reply_to_message_id``, from that message's destination node, of its type and run
(:func:`fedhier.engines.reply_binding.mismatch`). Anything else is a bad reply: a reply to a
message of an earlier batch (a replayed reply), to a message this run never sent, a second
reply to one message, a reply whose sender is not the node asked, and the error replies a
Grid makes for a ClientApp reply that did not answer its message
(:func:`fedhier.engines.reply_binding.bound`). Each is named by the client the message went
to (or, when it answers no message of this run, by the node it claims to come from).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message

from fedhier.engines.reply_binding import mismatch, unbound_reason
from fedhier.strategies.replies import ContractError

#: Earlier messages remembered to name a replayed reply (message id -> node, batch).
HISTORY = 100_000


def sender(node: int | None, client: int | None) -> str:
    """'client 3 (node 123...)', 'node 123...' (client unknown) or 'a client'."""
    if client is None:
        return "a client" if node is None else f"node {node}"
    return f"client {client} (node {node})"


@dataclass
class Bound:
    """The replies of one batch: ``answers`` (message sent, its reply) for every message
    with a reply that answers it (an error reply included); ``bad`` (error, client or None)
    for every other reply; ``unanswered`` the messages no reply names."""

    answers: list[tuple[Message, Message]] = field(default_factory=list)
    bad: list[tuple[ContractError, int | None]] = field(default_factory=list)
    unanswered: list[Message] = field(default_factory=list)


class SentMessages:
    """The messages one executor has sent, by id (the last :data:`HISTORY` of them)."""

    def __init__(self) -> None:
        self.earlier: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def bind(self, messages: Iterable[Message], replies: Iterable[Message], what: str,
             client_of_node: dict[int, int]) -> Bound:
        """Bind ``replies`` to ``messages`` (the batch ``what``, e.g. 'edge round 3', just
        sent; each already has its message id), then remember the batch."""
        sent = {m.metadata.message_id: m for m in messages if m.metadata.message_id}
        replies = list(replies)
        count = Counter(r.metadata.reply_to_message_id for r in replies)
        out = Bound()
        answered: set[str] = set()
        for reply in replies:
            rid = reply.metadata.reply_to_message_id
            message = sent.get(rid)
            if message is None:
                out.bad.append(self._stray(reply, what, client_of_node))
                continue
            answered.add(rid)
            node = message.metadata.dst_node_id
            client = client_of_node.get(node)
            why = unbound_reason(reply)
            if why is None:
                why = mismatch(message, reply)
                why = None if why is None else f"its reply does not answer its message: {why}"
            if why is None and count[rid] > 1:
                why = f"{count[rid]} replies answer its message"
            if why is not None:
                out.bad.append((ContractError(f"{sender(node, client)} in {what}: {why}"),
                                client))
                continue
            out.answers.append((message, reply))
        out.unanswered = [m for mid, m in sent.items() if mid not in answered]
        for mid, message in sent.items():
            self.earlier[mid] = (message.metadata.dst_node_id, what)
        while len(self.earlier) > HISTORY:
            self.earlier.popitem(last=False)
        return out

    def _stray(self, reply: Message, what: str,
               client_of_node: dict[int, int]) -> tuple[ContractError, int | None]:
        """A reply to no message of the batch: a replay of an earlier one, or to none."""
        rid = reply.metadata.reply_to_message_id
        src = reply.metadata.src_node_id
        if rid in self.earlier:
            node, earlier = self.earlier[rid]
            client = client_of_node.get(node)
            return (ContractError(f"{sender(node, client)} replied in {what} to its message "
                                  f"of {earlier}: a replayed reply"),
                    client if src == node else None)
        return (ContractError(f"a reply from {sender(src, client_of_node.get(src))} in "
                              f"{what} answers no message this run sent "
                              f"(reply_to_message_id {rid[:12]!r})"), None)
