"""Action streams generated as the run goes: the same as the lists, and only asking a little ahead."""

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.schedule import KINDS, Batches, Op, make_schedule, twobw_min_microbatches, worker_actions


class Recorder:
    """A run of ``count`` batches that remembers the furthest batch it was asked about."""

    def __init__(self, count: int) -> None:
        self.count, self.furthest = count, -1

    def has(self, batch: int) -> bool:
        self.furthest = max(self.furthest, batch)
        return batch < self.count


layouts = st.lists(st.integers(1, 3), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(KINDS)), layouts, st.integers(1, 5), st.integers(1, 9))
def test_streams_equal_the_lists_and_ask_about_batches_near_the_work(
    name: str, replicas: list[int], microbatches: int, batches: int
) -> None:
    """Generation asks whether a batch exists at most a pipeline's depth ahead of the microbatch it emits
    (the run-length protocol of the runtime relies on this bound: ``conveyor.runtime._feed.read_ahead``)."""
    if name == "2bw":
        microbatches = max(microbatches, twobw_min_microbatches(replicas))
    schedule = make_schedule(name, len(replicas), microbatches, batches, replicas)
    workers = sum(replicas)
    for w in range(workers):
        run = Recorder(batches)
        emitted, latest = [], 0
        for action in worker_actions(KINDS[name], w, replicas, microbatches, run):
            emitted.append(action)
            if action.microbatch is not None:
                latest = max(latest, action.microbatch)
            if run.furthest < batches:  # questions past the end come only once the worker's own work is done
                assert run.furthest * microbatches <= latest + 3 * workers, (w, action)
        assert tuple(emitted) == schedule.actions[w]


def test_a_run_of_unknown_length_stops_where_its_batches_do() -> None:
    kind = KINDS["pipedream"]
    actions = list(worker_actions(kind, 0, [1, 1], 2, Batches(3)))
    assert [a.microbatch for a in actions if a.op is Op.FORWARD] == list(range(6))
    assert sum(a.op is Op.STEP for a in actions) == 6
