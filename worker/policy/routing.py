"""Whether the live replicas agree on where a message name goes, and which cluster-wide settings they differ on.

Every replica publishes its routes as ``route key -> digest`` (a key is a message name or ``*``, the fallback; the
digest is of the route as logs show it, credentials redacted, so a rotated secret is no disagreement). A name's
route on a replica is its own key's, else the fallback's, else none — as the router resolves it. A replica calls a
message only when every live replica resolves its name to the same digest: a message is never delivered by a
replica whose routing for its name differs from another's, whichever of them is right. A name they disagree on
waits, uncharged, until they agree (the replica with the other routes stops, or is given the same ones).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

FALLBACK = "*"


def route_digests(descriptions: Mapping[str, str]) -> dict[str, str]:
    """A replica's routes as published: each key's description (credentials redacted) as a short digest."""
    return {key: hashlib.blake2b(text.encode(), digest_size=8).hexdigest() for key, text in descriptions.items()}


def routes_fingerprint(routes: Mapping[str, str]) -> str:
    """A replica's whole routing as a short digest: replicas with the same routes show the same one."""
    text = "\n".join(f"{key}={digest}" for key, digest in sorted(routes.items()))
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def resolve(routes: Mapping[str, str], name: str) -> str | None:
    """The digest of the route a replica with these routes calls for ``name`` (None: it has no route for it)."""
    found = routes.get(name)
    return found if found is not None else routes.get(FALLBACK)


@dataclass(frozen=True)
class Routing:
    """This replica's routes beside the other live replicas' (replica -> routes), as of the last look.

    ``known`` is False until a look succeeded: nothing is called before the replica knows who else runs.
    """

    own: Mapping[str, str]
    others: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    known: bool = True
    # The live replicas whose routes are not this replica's (by replica).
    differing: Mapping[str, Mapping[str, str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "differing", {
            replica: routes for replica, routes in self.others.items() if dict(routes) != dict(self.own)
        })

    def agrees(self, name: str) -> bool:
        """Whether every live replica sends ``name`` where this one does."""
        if not self.known:
            return False
        if not self.differing:
            return True
        mine = resolve(self.own, name)
        return all(resolve(routes, name) == mine for routes in self.differing.values())

    def keys_differing(self, replica: str) -> list[str]:
        """The route keys whose routes differ between this replica and ``replica`` (one of them lacks it, or
        they name different routes), sorted."""
        theirs = self.differing.get(replica, {})
        return sorted(key for key in set(self.own) | set(theirs) if self.own.get(key) != theirs.get(key))


def settings_differing(
    own: Mapping[str, str], others: Mapping[str, Mapping[str, str]]
) -> list[tuple[str, str, str, str]]:
    """Cluster-wide settings another live replica runs with a different value: (setting, replica, its value, this
    replica's value), by setting and replica. A setting a replica does not publish (an older release) is left out."""
    found = []
    for replica, settings in sorted(others.items()):
        for name, value in sorted(settings.items()):
            if name in own and own[name] != value:
                found.append((name, replica, value, own[name]))
    return found
