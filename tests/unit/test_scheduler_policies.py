"""Policy objects: the factory, and what each tells the engine it needs."""

from __future__ import annotations

import pytest

from queue_service.scheduler import POLICIES, FlowPrefill, make_policy
from queue_service.scheduler.policies import ABLATIONS, Chunked


@pytest.mark.parametrize(
    ("name", "check", "preempts", "drop_state"),
    [
        ("fifo", "none", False, False),
        ("priority", "none", False, False),
        ("chunked", "chunk", True, False),
        ("recompute", "block", True, True),
        ("flowprefill", "block", True, False),
        # Ablations: flowprefill or a baseline with one part swapped.
        ("flowprefill-chunk", "chunk", True, False),
        ("priority-layer", "layer", True, False),
        ("flowprefill-recompute", "block", True, True),
        ("flowprefill-layer", "layer", True, False),
    ],
)
def test_each_policy_states_its_engine_needs(name, check, preempts, drop_state):
    policy = make_policy(name)
    assert policy.name == name
    assert (policy.engine_check, policy.preempts, policy.drop_state) == (
        check,
        preempts,
        drop_state,
    )


def test_factory_knows_every_policy_and_rejects_unknown_names():
    assert set(POLICIES) == {"fifo", "priority", "chunked", "recompute", "flowprefill"}
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'; choose one of: fifo"):
        make_policy("sjf")
    with pytest.raises(ValueError, match="does not take options"):
        make_policy("fifo", switch_s=0.1)


def test_ablations_keep_their_parents_rules_but_not_their_registry_entry():
    assert set(ABLATIONS) & set(POLICIES) == set()  # `tierflow bench` runs the five by default
    for name in ("flowprefill-chunk", "flowprefill-recompute", "flowprefill-layer"):
        assert isinstance(make_policy(name, switch_s=0.01), FlowPrefill)
    assert isinstance(make_policy("priority-layer"), Chunked)


def test_flowprefill_options():
    policy = make_policy("flowprefill", switch_s=0.005)
    assert isinstance(policy, FlowPrefill) and policy.switch_s == 0.005
    with pytest.raises(ValueError):
        FlowPrefill(switch_s=-1.0)
