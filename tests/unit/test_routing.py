"""Whether replicas agree on a message name's route, and which cluster-wide settings they run differently."""

from __future__ import annotations

import pytest

from worker.policy.routing import Routing, resolve, route_digests, routes_fingerprint, settings_differing

LOG, HANDLER, CAMUNDA = "log", "shop.handlers:on_paid", "type=camunda8, mode=correlate"


def table(mapping: dict[str, str]) -> dict[str, str]:
    return route_digests(mapping)


def test_a_name_resolves_to_its_own_route_else_the_fallback_else_none() -> None:
    mine = table({"order.paid": HANDLER, "*": LOG})
    assert resolve(mine, "order.paid") == mine["order.paid"]
    assert resolve(mine, "anything") == mine["*"]
    assert resolve(table({"order.paid": HANDLER}), "anything") is None


@pytest.mark.parametrize(("own", "other", "name", "agrees"), [
    # a replica started without CORRELATION_CORRELATORS beside one with a route: the routed name waits
    ({"order.paid": HANDLER, "*": LOG}, {"*": LOG}, "order.paid", False),
    ({"order.paid": HANDLER, "*": LOG}, {"*": LOG}, "audit.note", True),
    # the same route under an explicit key on one and the fallback on the other: alike
    ({"order.paid": LOG}, {"*": LOG}, "order.paid", True),
    # a rolling update changing the fallback: every name not routed explicitly by both waits
    ({"order.paid": HANDLER, "*": LOG}, {"order.paid": HANDLER, "*": CAMUNDA}, "x", False),
    ({"order.paid": HANDLER, "*": LOG}, {"order.paid": HANDLER, "*": CAMUNDA}, "order.paid", True),
    # no route on one replica, a route on the other
    ({"order.paid": HANDLER}, {"order.paid": HANDLER, "*": LOG}, "x", False),
    ({}, {}, "x", True),
])
def test_a_name_is_called_only_when_every_live_replica_routes_it_alike(
    own: dict[str, str], other: dict[str, str], name: str, agrees: bool
) -> None:
    routing = Routing(table(own), {"b": table(other)})
    assert routing.agrees(name) is agrees
    assert Routing(table(other), {"a": table(own)}).agrees(name) is agrees, "the same answer on either side"


def test_alone_or_among_replicas_routing_alike_every_name_agrees_and_before_the_first_look_none_does() -> None:
    mine = table({"order.paid": HANDLER, "*": LOG})
    assert Routing(mine).agrees("x")
    assert Routing(mine, {"b": dict(mine), "c": dict(mine)}).differing == {}
    assert not Routing(mine, known=False).agrees("x")


def test_one_replica_of_several_routing_differently_holds_the_name_and_is_named() -> None:
    mine = table({"order.paid": HANDLER, "*": LOG})
    routing = Routing(mine, {"b": dict(mine), "c": table({"*": LOG})})
    assert not routing.agrees("order.paid") and routing.agrees("other")
    assert list(routing.differing) == ["c"]
    assert routing.keys_differing("c") == ["order.paid"]


def test_a_route_is_compared_by_what_logs_show_so_a_rotated_secret_is_no_disagreement() -> None:
    redacted = "type=http, url=https://engine/, headers={\"Authorization\": \"***\"}"
    assert route_digests({"*": redacted}) == route_digests({"*": redacted})
    assert routes_fingerprint(table({"*": LOG})) != routes_fingerprint(table({"*": HANDLER}))
    assert routes_fingerprint(table({"a": LOG, "*": LOG})) == routes_fingerprint(table({"*": LOG, "a": LOG}))


def test_settings_another_replica_runs_differently_are_listed_and_unpublished_ones_left_out() -> None:
    own = {"delivery.retention": "P7D", "lease.duration": "PT40S"}
    others = {"b": {"delivery.retention": "PT1S", "lease.duration": "PT40S"}, "c": {"lease.duration": "PT10S",
                                                                                     "new.setting": "x"}}
    assert settings_differing(own, others) == [
        ("delivery.retention", "b", "PT1S", "P7D"), ("lease.duration", "c", "PT10S", "PT40S"),
    ]


def test_a_replica_publishes_its_cluster_wide_settings_as_text() -> None:
    from datetime import timedelta

    from worker.config import PolicyOverride, Settings
    from worker.engine.replicas import CLUSTER_SETTINGS, cluster_settings, setting_name

    settings = Settings().model_copy(update={
        "delivery": Settings().delivery.model_copy(update={"retention": timedelta(seconds=1)}),
        "policies": {"order.paid": PolicyOverride(max_retries=2)},
    })
    shown = cluster_settings(settings)
    assert set(shown) == set(CLUSTER_SETTINGS)
    assert shown["delivery.retention"] == "PT1S" and shown["lease.duration"] == "PT40S"
    assert shown["scheduler.enabled"] == "true"
    assert '"max_retries": 2' in shown["policies"] and shown["policies"] != cluster_settings(Settings())["policies"]
    assert setting_name("delivery.retention") == "CORRELATION_DELIVERY__RETENTION"
