"""The fast list scheduling of ZB-H1 over a virtual pipeline and Megatron's interleaved order
(``launcher.core.schedules``) against the straightforward versions they replaced (tests/_schedules_reference.py):
the rank executor runs these op lists literally and the planner's memory and timing read them, so they must be
equal op for op, over a grid of pipeline sizes, microbatch counts (up to 512), chunks and microbatch groups."""
from __future__ import annotations

import pytest
from _schedules_reference import schedule_interleaved as ref_interleaved
from _schedules_reference import zb_h1_interleaved as ref_zb_h1

from launcher.core.schedules import _zb_h1_interleaved, schedule_interleaved, schedule_zb_h1

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
