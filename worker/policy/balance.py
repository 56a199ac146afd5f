"""Slot balancing (DESIGN.md §4), pure: each replica's fair share and its move in one lease round.

Each replica aims for its fair share of the S slots among the live replicas: ``floor(S / n)``, plus one for
the ``S mod n`` replicas that hold the most. A short replica takes free slots; a replica above its share hands
back surplus only while another one is short (never going below its share). While no other live replica is
short, a replica takes every free slot, however many: slots left by a replica that died are owned again at
the next round, whatever the shares say, and handed back later if a new replica needs them.

A slot whose term *lapsed* (its holder stopped renewing it: died, frozen, cut off; a slot handed back or given
up at shutdown is released instead, and is not lapsed) is taken by whichever replica's round sees it first,
short replicas or not: its hints' work waits for no one's share, so a dead replica's slots are held again
within a renew interval of their terms' end. The shares are restored afterwards by the usual hand-backs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Balance:
    """What one replica should do this round: its share, how many slots to take, which to hand back."""

    target: int
    acquire: int
    hand_back: tuple[int, ...]


def fair_shares(slot_count: int, holdings: Mapping[str, int]) -> dict[str, int]:
    """Each live replica's share of the slots: ``floor(S / n)``, one more for the ``S mod n`` holding most.

    ``holdings`` maps every live replica to how many slots it holds now. Ties go by name, so that every
    replica computes the same shares from the same view; favouring those holding most moves fewest slots.
    """
    if not holdings:
        return {}
    base, extra = divmod(slot_count, len(holdings))
    ranked = sorted(holdings, key=lambda replica: (-holdings[replica], replica))
    return {replica: base + (1 if rank < extra else 0) for rank, replica in enumerate(ranked)}


def balance(
    slot_count: int, me: str, mine: Sequence[int], others: Mapping[str, int], lapsed: int = 0
) -> Balance:
    """This replica's move: take slots up to its share (or every free one), or hand back surplus.

    ``mine``: the slots this replica holds; ``others``: every other live replica and how many slots it
    holds (zero for one that only renews its membership); ``lapsed``: free slots whose term ran out unrenewed.
    Surplus is handed back only while the other replicas' shortfall exceeds the free slots (which they can
    take themselves), never below the share; the last of ``mine`` go first (the leaser lists its slots newest
    term first, so that those it has held longest go back). With no other replica short, every free slot is
    taken; lapsed slots are taken in any case.
    """
    holdings = {**others, me: len(mine)}
    shares = fair_shares(slot_count, holdings)
    target = shares[me]
    shortfall = sum(max(0, shares[replica] - held) for replica, held in holdings.items() if replica != me)
    free = max(0, slot_count - sum(holdings.values()))
    lapsed = min(lapsed, free)
    if len(mine) <= target:
        wanted = target - len(mine)
        return Balance(target, max(wanted, free) if shortfall == 0 else max(wanted, lapsed), ())
    if shortfall == 0:
        return Balance(target, free, ())
    if lapsed:  # held again first; the surplus goes back at the next rounds
        return Balance(target, lapsed, ())
    give = min(len(mine) - target, max(0, shortfall - free))
    ordered = list(mine)
    return Balance(target, 0, tuple(ordered[len(ordered) - give :]))
