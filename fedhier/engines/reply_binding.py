"""Which request a reply answers: a reply counts only as the answer to the message it names.

A Flower reply names the message it answers (``reply_to_message_id``) and its sender
(``src_node_id``); Flower's SuperLink drops a reply whose reply-to id it does not hold or whose
sender is not that message's destination. A Grid that calls ClientApps itself (the in-process
grid, the Simulation Engine's backend as fedhier runs it) knows exactly which message each
reply was returned for, and hands on a reply that does not answer it as an error reply *to*
that message (:func:`bound`, code :data:`UNBOUND_CODE`) saying what did not match, so the
server names the client it asked (docs/security.md). The executor checks every reply again
against the messages it sent (:func:`mismatch`), whatever the Grid.
"""

from __future__ import annotations

from flwr.app import Error, Message
from flwr.common.constant import SUPERLINK_NODE_ID

#: The error code of a reply that did not answer the message it was returned for.
UNBOUND_CODE = 41
#: The first words of such an error reply's reason.
UNBOUND = "its reply does not answer the message it was sent"


def mismatch(sent: Message, reply: Message) -> str | None:
    """What of ``reply`` does not match ``sent`` (the message it says it answers), or None:
    its reply-to id, sender (``src_node_id`` = ``sent``'s destination; a SuperLink's own
    error reply, e.g. for an expired message, comes from the SuperLink), message type and
    run."""
    m, r = sent.metadata, reply.metadata
    problems = []
    if r.reply_to_message_id != m.message_id:
        problems.append(f"reply_to_message_id {_short(r.reply_to_message_id)} is not its "
                        f"message's {_short(m.message_id)}")
    own_error = reply.has_error() and r.src_node_id == SUPERLINK_NODE_ID
    if r.src_node_id != m.dst_node_id and not own_error:
        problems.append(f"src_node_id {r.src_node_id} is not node {m.dst_node_id}, the "
                        "destination of that message")
    if r.message_type != m.message_type:
        problems.append(f"message_type '{r.message_type}' answers a '{m.message_type}' "
                        "message")
    if r.run_id != m.run_id:
        problems.append(f"run_id {r.run_id} is not this run's {m.run_id}")
    return "; ".join(problems) or None


def bound(sent: Message, reply: object) -> Message:
    """``reply`` when it answers ``sent``; else an error reply to ``sent``
    (:data:`UNBOUND_CODE`) saying what did not match (also when the ClientApp returned no
    Message at all)."""
    why: str | None = f"the ClientApp returned a {type(reply).__name__}, not a Message"
    if isinstance(reply, Message):
        why = mismatch(sent, reply)
        if why is None:
            return reply
    return Message(Error(code=UNBOUND_CODE, reason=f"{UNBOUND}: {why}"), reply_to=sent)


def unbound_reason(reply: Message) -> str | None:
    """The reason of an error reply :func:`bound` made (None for any other reply)."""
    if not reply.has_error() or reply.error.code != UNBOUND_CODE:
        return None
    return reply.error.reason or UNBOUND


def _short(message_id: str) -> str:
    return repr(message_id[:12] + ("..." if len(message_id) > 12 else ""))
