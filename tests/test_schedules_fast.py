"""The fast list scheduling of ZB-H1 over a virtual pipeline and Megatron's interleaved order
(``launcher.core.pipeline.schedules``) against the straightforward versions they replaced (tests/_schedules_reference.py):
the rank executor runs these op lists literally and the planner's memory and timing read them, so they must be
equal op for op, over a grid of pipeline sizes, microbatch counts (up to 512), chunks and microbatch groups."""
from __future__ import annotations

import pytest
from _schedules_reference import schedule_interleaved as ref_interleaved
from _schedules_reference import zb_h1_interleaved as ref_zb_h1

from launcher.core.pipeline.schedules import _zb_h1_interleaved, schedule_interleaved, schedule_zb_h1

GRID = [(p, m, v, g) for p in (2, 3, 4, 8) for v in (2, 3, 4) for g in sorted({p, 2 * p, p + 1} - {0})
        for m in (g, 2 * g, 5 * g)] + [(8, 128, 4, 8), (16, 512, 2, 16), (4, 512, 6, 4), (16, 64, 6, 16),
                                       (8, 96, 3, 12)]


@pytest.mark.parametrize("p,m,v,g", GRID)
def test_zb_h1_interleaved_matches_reference(p, m, v, g):
    assert _zb_h1_interleaved(p, m, v, g) == ref_zb_h1(p, m, v, g)
    assert schedule_zb_h1(p, m, v, g) == [list(ops) for ops in ref_zb_h1(p, m, v, g)]


@pytest.mark.parametrize("p,m,v,g", GRID + [(4, 6, 2, 4), (3, 7, 3, None), (8, 20, 2, None)])
def test_schedule_interleaved_matches_reference(p, m, v, g):
    """Including microbatch counts the group does not divide (validate refuses them; the order is still defined)."""
    assert schedule_interleaved(p, m, v, g) == ref_interleaved(p, m, v, g)


def _front_pairwise(states) -> tuple:
    """zb_states._front as it was: every state against every other."""
    return tuple(s for s in states if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in states))


def test_front_matches_pairwise():
    """The planner's one-pass Pareto front of (in flight, pending W) states equals the pairwise one, in the
    states' order, on the op lists' own states and on random ones (duplicates, ties in either count)."""
    import random

    from launcher.plan.zb_states import _front, zb_h1_states, zb_v_states

    cases = [st for args in ((8, 64, 4, 8), (16, 64, 6, 16), (4, 24, 3, 6), (8, 32)) for st in zb_h1_states(*args)]
    cases += list(zb_v_states(4, 16))
    rnd = random.Random(0)
    cases += [[(rnd.randint(0, 6), rnd.randint(0, 6)) for _ in range(rnd.randint(1, 30))] for _ in range(500)]
    cases += [[(f / 2, w / 2) for f, w in st] for st in cases[:10]]
    for states in cases:
        assert _front(states) == _front_pairwise(states), states


def test_distinct_held_matches_held_after_each_op():
    """The planner's integer-coded distinct states equal the distinct states of held_after_each_op, on ZB-H1 (with
    and without chunks), ZB-V and 1F1B op lists."""
    from launcher.core.pipeline.schedules import schedule_1f1b, schedule_zb_v
    from launcher.plan.zb_states import _distinct_held, held_after_each_op

    lists = [ops for args in ((8, 64, 4, 8), (4, 24, 3, 6), (8, 32), (1, 4)) for ops in schedule_zb_h1(*args)]
    lists += schedule_zb_v(4, 16) + schedule_1f1b(4, 8) + [[]]
    for ops in lists:
        assert _distinct_held(ops) == tuple(sorted(set(held_after_each_op(ops))))


@pytest.mark.parametrize("p,m,v,g", [(2, 1, 1, None), (4, 3, 1, None), (8, 64, 1, None), (4, 8, 2, 4),
                                     (8, 64, 4, 8), (4, 24, 3, 6), (8, 8, 3, 8), (16, 64, 6, 16)])
def test_reached_states_are_reached(p, m, v, g):
    """The search drops a ZB-H1 candidate whose peak over zb_h1_reached_states exceeds the GPU without its exact
    peak: sound only if the op list reaches every one of those states on that rank."""
    from launcher.plan.zb_states import zb_h1_reached_states, zb_h1_states

    for reached, states in zip(zb_h1_reached_states(p, m, v, g), zb_h1_states(p, m, v, g)):
        assert set(reached) <= set(states), (reached, states)
