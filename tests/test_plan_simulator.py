"""The pipeline simulator reproduces the closed-form bubbles of 1F1B, interleaved and ZB-H1."""
import pytest

from launcher.plan.simulator import Op, build_schedule, simulate, simulate_kind

COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.3, 2.1, 0.7)]
SHAPES = [(2, 4), (4, 8), (4, 12), (8, 16), (8, 32)]


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_bubble(f, b, w, p, m):
    res = simulate_kind("1f1b", p, m, f, b, w)
    assert res.bubble == pytest.approx((p - 1) * (f + b + w))
    assert res.makespan == pytest.approx((m + p - 1) * (f + b + w))


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_bubble(f, b, w, p, m):
    res = simulate_kind("zb_h1", p, m, f, b, w)
    assert res.bubble == pytest.approx((p - 1) * (f + b - w))


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (2, 4, 2), (8, 16, 2), (4, 12, 3)])
def test_interleaved_bubble(f, b, w, p, m, v):
    res = simulate_kind("interleaved", p, m, f, b, w, v=v)
    assert res.bubble == pytest.approx((p - 1) * (f + b + w) / v)


@pytest.mark.parametrize("p,m", SHAPES)
def test_peak_in_flight(p, m):
    one = simulate_kind("1f1b", p, m, 1.0, 2.0, 1.0)
    zb = simulate_kind("zb_h1", p, m, 1.0, 2.0, 1.0)
    assert one.peak_in_flight[0] == min(p, m)
    assert one.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert all(z <= o for z, o in zip(zb.peak_in_flight, one.peak_in_flight))
    assert zb.peak_in_flight[0] <= p


def test_interleaved_in_flight_matches_megatron_warmup():
    p, v, m = 4, 2, 8
    res = simulate_kind("interleaved", p, m, 1.0, 1.0, 1.0, v=v)
    assert res.peak_in_flight == [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]


def test_uneven_stage_costs_and_comm():
    # A slow last stage dominates the steady state; sends add latency but never reorder.
    p, m = 4, 16
    f = [1.0, 1.0, 1.0, 1.5]
    res = simulate_kind("1f1b", p, m, f, [2.0] * 4, [1.0] * 4, t_comm=0.1)
    assert res.makespan >= m * (1.5 + 3.0)
    zb = simulate_kind("zb_h1", p, m, f, [2.0] * 4, [1.0] * 4, t_comm=0.1)
    assert zb.makespan < res.makespan
    # every op ran exactly once, in list order, without overlap on a rank
    for tl in res.timelines:
        assert all(a.end <= b.start + 1e-12 for a, b in zip(tl, tl[1:]))


def test_every_op_runs_once():
    for kind, v in (("1f1b", 1), ("zb_h1", 1), ("interleaved", 2)):
        sched = build_schedule(kind, 4, 8, v)
        res = simulate(sched, 1.0, 1.0, 1.0)
        for r, tl in enumerate(res.timelines):
            assert [s.op for s in tl] == sched[r]
        fw = sorted((s.op.microbatch, s.op.chunk) for tl in res.timelines for s in tl if s.op.kind == "F")
        assert len(fw) == 4 * 8 * v and len(set(fw)) == 8 * v  # each rank runs each (microbatch, chunk) once


def test_deadlock_is_reported():
    bad = [[Op("B", 0), Op("F", 0)], [Op("F", 0), Op("B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad, 1.0, 1.0, 1.0)


def test_result_is_json_able():
    import json

    json.dumps(simulate_kind("zb_h1", 2, 3, 1.0, 1.0, 1.0).to_dict())
