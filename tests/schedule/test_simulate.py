"""The simulator predicts the step time and stash of a schedule's action lists."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.schedule import SCHEDULES, Op, flush, gpipe, make_schedule, simulate, twobw_min_microbatches

times = st.floats(0.1, 10.0)


@given(st.integers(1, 8), st.integers(1, 12), times, times, st.sampled_from(sorted(SCHEDULES)))
def test_equal_stages_take_m_plus_p_minus_1_slots(p: int, m: int, tf: float, tb: float, name: str) -> None:
    m = max(m, twobw_min_microbatches([1] * p)) if name == "2bw" else m
    result = simulate(make_schedule(name, p, m), forward_s=tf, backward_s=tb)
    assert result.step_s == pytest.approx((m + p - 1) * (tf + tb))


def test_transfer_time_is_paid_on_every_hop_of_fill_and_drain() -> None:
    # One microbatch through 3 stages: 3 forwards, 2 hops down, 3 backwards, 2 hops back.
    result = simulate(gpipe(3, 1), forward_s=1.0, backward_s=2.0, transfer_s=0.5)
    assert result.step_s == pytest.approx(3 * 1.0 + 3 * 2.0 + 4 * 0.5)


def test_slowest_stage_sets_the_pace() -> None:
    # GPipe with a bottleneck stage: after the fill, the slow stage runs back to back.
    result = simulate(gpipe(2, 4), forward_s=[1.0, 3.0], backward_s=[1.0, 3.0])
    assert result.step_s == pytest.approx(1.0 + 4 * 3.0 + 4 * 3.0 + 1.0)


def test_optimizer_step_time_is_added() -> None:
    assert simulate(flush(2, 2), 1.0, 1.0, step_s=0.5).step_s == pytest.approx(3 * 2.0 + 0.5)


def test_busy_time_and_efficiency() -> None:
    result = simulate(flush(4, 8), forward_s=1.0, backward_s=2.0)
    assert result.busy_s == [24.0] * 4
    assert result.efficiency() == pytest.approx(8 / 11)


def test_timeline_lists_every_compute_action() -> None:
    result = simulate(gpipe(2, 3), 1.0, 1.0)
    assert len(result.timeline) == 2 * (3 + 3 + 2)  # forwards, backwards, reduce, step
    assert all(end >= start for _, _, start, end in result.timeline)


def test_per_stage_values_must_match_the_stage_count() -> None:
    with pytest.raises(ValueError, match="forward_s needs 3 values"):
        simulate(gpipe(3, 2), forward_s=[1.0, 2.0], backward_s=1.0)


def test_replicas_reduce_together() -> None:
    # Stage 0 has 2 replicas with one microbatch each; stage 1 runs both microbatches. Replica 0's
    # microbatch finishes first, but its reduce (an all-reduce) waits for replica 1's.
    result = simulate(flush(2, 2, replicas=[2, 1]), forward_s=1.0, backward_s=1.0, reduce_s=[0.5, 0.0])
    ends = {(w, str(a)): end for w, a, _, end in result.timeline}
    # Replica 0's backward ends at 4 (stage 1 serves microbatch 0 first), replica 1's at 6: both reduce at 6.
    assert ends[(0, "B0")] == 4.0 and ends[(1, "B1")] == 6.0
    reduces = {w: (start, end) for w, a, start, end in result.timeline if a.op is Op.REDUCE_GRAD and w < 2}
    assert reduces == {0: (6.0, 6.5), 1: (6.0, 6.5)}


def test_messages_cost_their_sender_and_receiver() -> None:
    # One microbatch through 2 stages: the activation and the gradient each cost 0.25 to send, 0.5 on the
    # link and 0.125 to receive.
    result = simulate(gpipe(2, 1), 1.0, 1.0, transfer_s=0.5, send_s=0.25, recv_s=0.125)
    assert result.step_s == pytest.approx(4 * 1.0 + 2 * (0.25 + 0.5 + 0.125))


def test_workers_share_the_cores_they_want_at_the_same_moment() -> None:
    # Four replicas computing at once on two cores take twice as long; on four cores, as long as on their own.
    dp = flush(1, 4, replicas=[4])
    alone = simulate(dp, 1.0, 2.0).step_s
    assert simulate(dp, 1.0, 2.0, cores=4).step_s == pytest.approx(alone)
    assert simulate(dp, 1.0, 2.0, cores=2).step_s == pytest.approx(2 * alone)
    # A pipeline's workers mostly take turns: sharing two cores costs less than twice.
    pipe = flush(4, 4)
    assert (
        simulate(pipe, 1.0, 2.0).step_s < simulate(pipe, 1.0, 2.0, cores=2).step_s < 2 * simulate(pipe, 1.0, 2.0).step_s
    )


def test_a_reduce_waits_on_the_network_and_uses_no_core() -> None:
    dp = flush(1, 2, replicas=[2])
    assert simulate(dp, 1.0, 1.0, reduce_s=5.0, cores=1).step_s == pytest.approx(2 * 2.0 + 5.0)
    with pytest.raises(ValueError, match="cores must be at least 1"):
        simulate(dp, 1.0, 1.0, cores=0)


def test_latency_delays_a_message_without_holding_the_link() -> None:
    # Two activations back to back over one boundary: each keeps the link 0.5 s, then flies 2 s more; the
    # second need not wait for the first one's flight.
    result = simulate(gpipe(2, 2), forward_s=1.0, backward_s=1.0, transfer_s=0.5, latency_s=2.0)
    forward_1 = next(start for w, a, start, _ in result.timeline if w == 1 and str(a) == "F1")
    assert forward_1 == pytest.approx(2.0 + 0.5 + 2.0)  # sent at 2 (after F1 on stage 0), link, flight


def test_negative_times_are_rejected() -> None:
    with pytest.raises(ValueError, match="times must be >= 0"):
        simulate(flush(2, 2), 1.0, 1.0, reduce_s=-5.0)


def test_workers_of_a_group_share_its_link_to_the_next_level() -> None:
    # Two replicas of each of two stages, 1 s per forward, backward and message. On their own links both
    # activations cross at once: 1 (forward) + 1 + 1 + 1 (backward) + 1 + 1 = 6 s. With both stages' workers in
    # a server of their own, the servers' links carry one message at a time each way: the second activation
    # and then the second gradient wait 1 s each, which the reduce waits for.
    dp = flush(2, 2, replicas=[2, 2])
    assert simulate(dp, 1.0, 1.0, transfer_s=1.0).step_s == pytest.approx(6.0)
    assert simulate(dp, 1.0, 1.0, transfer_s=1.0, groups=[(0,), (1,), (2,), (3,)]).step_s == pytest.approx(6.0)
    assert simulate(dp, 1.0, 1.0, transfer_s=1.0, groups=[(0,), (0,), (1,), (1,)]).step_s == pytest.approx(7.0)
    with pytest.raises(ValueError, match="groups needs one entry per worker"):
        simulate(dp, 1.0, 1.0, groups=[(0,)])
