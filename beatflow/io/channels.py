"""Choosing a recording's channel by index (``--lead 0``) or by label (``--lead MLII``).

Imports nothing heavy: the command line uses :func:`parse_lead` to build its options.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from beatflow.errors import InputError

#: a channel: its index (0-based) or its label
Lead = int | str


def parse_lead(text: str) -> Lead:
    """``--lead``/``--confirm-lead`` as given: an integer is an index, anything else a label."""
    t = text.strip()
    if re.fullmatch(r"[+-]?\d+", t):
        return int(t)
    if not t:
        raise argparse.ArgumentTypeError("expected a channel index or label, got an empty string")
    return t


def describe(lead: Lead) -> str:
    """A channel as the messages show it: ``0`` or ``'MLII'``."""
    return str(lead) if isinstance(lead, int) else repr(lead)


def listing(labels: Sequence[str], skip: Sequence[int] = ()) -> str:
    """``0 'MLII', 1 'V5'``: the channels one may choose, with their indices."""
    return ", ".join(f"{i} {label!r}" for i, label in enumerate(labels) if i not in skip) or "none"


def pick_channel(where: str, labels: Sequence[str], lead: Lead, option: str = "--lead",
                 skip: Sequence[int] = ()) -> int:
    """The index of channel ``lead`` among ``labels``.

    A label matches regardless of case and surrounding spaces; ``skip`` lists the indices that are
    no signal one may choose (annotation channels).

    Raises
    ------
    InputError
        ``{where}: {option} X: ...`` when no channel (or more than one) matches, listing the channels.
    """
    if isinstance(lead, int):
        if 0 <= lead < len(labels) and lead not in skip:
            return lead
        raise InputError(f"{where}: {option} {lead}: no such channel (channels: {listing(labels, skip)})")
    key = lead.strip().casefold()
    hits = [i for i, label in enumerate(labels) if label.strip().casefold() == key and i not in skip]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise InputError(f"{where}: {option} {lead!r}: no channel of that label (channels: {listing(labels, skip)})")
    raise InputError(f"{where}: {option} {lead!r}: {len(hits)} channels have that label "
                     f"({', '.join(map(str, hits))}); choose one by its index")
