"""The profile query's replies, read into who the clients are and what they may claim.

Each node's reply names its partition id (the client it serves), its rows, label histogram
and edge tag (docs/contract.md). A node whose reply is missing (an error reply, no reply
within the timeout, a reply dropped as not answering its message), names no whole-number
partition id, one outside the run's clients, or one another node names too, **failed the
profile query**: under ``on_bad_reply="stop"`` the run stops with one line; under ``drop``
the client (each partition id no usable reply names) is left out of the run, named in one
warning and in the records' ``excluded_clients``, and the others train
(docs/security.md). A bad size or histogram in a usable reply is a bad reply of its own
(:class:`~fedhier.round.reply_policy.ReplyGuard`): the client stays, bounded by the number it
reported well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from flwr.app import Message

from fedhier.round.faults import RunFailureError
from fedhier.round.reply_policy import ReplyGuard
from fedhier.strategies.cloud_failure import error_summary
from fedhier.strategies.replies import ContractError, check_histogram, num_examples_of, who
from fedhier.tree.grouping import ClientInfo

log = logging.getLogger("fedhier")


@dataclass(frozen=True)
class Profile:
    """One node's usable profile: ``declared`` is the most rows its replies may claim (its
    histogram's sum, or its ``num-examples`` where it reported no usable histogram; 0 =
    neither)."""

    client: int
    node: int
    size: int
    histogram: list[int]
    tag: int
    declared: int


def read_profile(reply: Message, classes: int | None, guard: ReplyGuard) -> Profile:
    """The profile in ``reply`` (not an error reply). A missing partition id raises
    ContractError; a bad size or histogram is a bad reply (stop, or dropped: the other
    number declares the size)."""
    metrics = reply.content.metric_records.get("metrics")
    pid = metrics.get("partition-id") if metrics is not None else None
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise ContractError(f"{who(reply, None)} answered the profile query without a "
                            "whole-number 'partition-id' (docs/contract.md)")
    assert metrics is not None
    tag = metrics.get("edge-tag", -1)
    size, histogram = 0, []
    try:
        size = num_examples_of(reply, None)
    except ContractError as exc:
        guard.bad(exc, None, training=False)
    try:
        histogram = check_histogram(reply, metrics.get("label-histogram", []), classes)
    except ContractError as exc:
        guard.bad(exc, None, training=False)
    declared = sum(histogram) or size
    return Profile(pid, reply.metadata.src_node_id, size, histogram,
                   int(tag) if isinstance(tag, int) and not isinstance(tag, bool) else -1,
                   declared)


def usual_length(replies: list[Message]) -> int | None:
    """The label-histogram length most profile replies report (None: none reports one)."""
    lengths: dict[int, int] = {}
    for reply in replies:
        metrics = None if reply.has_error() else reply.content.metric_records.get("metrics")
        histogram = metrics.get("label-histogram") if metrics is not None else None
        if isinstance(histogram, list) and histogram:
            lengths[len(histogram)] = lengths.get(len(histogram), 0) + 1
    return max(lengths, key=lambda n: (lengths[n], n)) if lengths else None


def read_profiles(nodes: list[int], answers: dict[int, Message], wanted: list[int] | None,
                  guard: ReplyGuard, timeout: float) -> tuple[list[Profile], dict[int, str]]:
    """The usable profiles of ``nodes`` (``answers``: node -> its bound reply), sorted by
    client, and the left-out clients (partition id -> why); ``wanted``: the partition ids
    the nodes must report (default 0 .. len(nodes) - 1). Under ``stop`` a failed node
    raises (RunFailureError; ContractError for a reply without a partition id)."""
    stop = guard.policy.on_bad_reply == "stop"
    classes = usual_length(list(answers.values()))
    failed: dict[int, str] = {}  # node -> why
    usable: list[Profile] = []
    silent = [n for n in nodes if n not in answers]
    if silent and stop:
        raise RunFailureError(f"{len(silent)} of {len(nodes)} nodes did not answer the "
                              f"profile query within {timeout:.0f} s")
    for node in silent:
        failed[node] = f"no usable reply within {timeout:.0f} s"
    for node in nodes:
        reply = answers.get(node)
        if reply is None:
            continue
        if reply.has_error():
            reason = error_summary(reply.error.reason)
            if stop:
                raise RunFailureError(f"node {node} failed the profile query: {reason}")
            failed[node] = f"failed: {reason}"
            continue
        try:
            usable.append(read_profile(reply, classes, guard))
        except ContractError as exc:
            guard.bad(exc, None, training=False)
            failed[node] = "no whole-number partition id"
    gapless = wanted is None  # the clients are 0 .. n-1 of this grid's n nodes
    wanted = list(range(len(nodes))) if wanted is None else sorted(wanted)
    claims: dict[int, list[Profile]] = {}
    for profile in usable:
        claims.setdefault(profile.client, []).append(profile)
    ids = sorted(p.client for p in usable)
    if stop and ids != wanted:
        if gapless:
            raise RunFailureError(f"partition ids must be 0..n-1 without gaps, got {ids[:10]}")
        raise RunFailureError(f"the nodes report partition ids {ids[:10]}, expected "
                              f"{wanted[:10]}")
    kept = []
    for client, profiles in sorted(claims.items()):
        if client not in wanted:
            failed.update({p.node: f"reports partition id {client}, not one of the run's "
                                   "clients" for p in profiles})
        elif len(profiles) > 1:
            failed.update({p.node: f"reports partition id {client}, as "
                                   f"{len(profiles) - 1} other node(s) do" for p in profiles})
        else:
            kept.append(profiles[0])
    said = "; ".join(f"node {n}: {why}" for n, why in sorted(failed.items())[:5])
    if not kept:
        raise RunFailureError(f"no node sent a usable reply to the profile query ({said})")
    served = {p.client for p in kept}
    left_out = {c: "no usable profile reply" for c in wanted if c not in served}
    if failed:
        log.warning("the profile query: client(s) %s left out of the run (%s)",
                    sorted(left_out)[:10], said)
    return kept, left_out


def client_info(kept: list[Profile], wanted: list[int]) -> ClientInfo:
    """The ClientInfo of ``wanted`` (sorted partition ids, one row each) from the usable
    profiles ``kept``; a left-out client's row reports nothing (zeros, tag -1)."""
    row = {c: i for i, c in enumerate(wanted)}
    classes = max((len(p.histogram) for p in kept), default=0)
    histograms = np.zeros((len(wanted), classes), dtype=np.int64)
    sizes = np.zeros(len(wanted), dtype=np.int64)
    tags = np.full(len(wanted), -1, dtype=np.int64)
    for p in kept:
        histograms[row[p.client], :len(p.histogram)] = p.histogram
        sizes[row[p.client]] = p.size
        tags[row[p.client]] = p.tag
    return ClientInfo(label_histograms=histograms, num_examples=sizes, edge_tags=tags)
