"""Host staging rings: a refill of a host buffer its copy may not have read yet is refused before
anything runs, seen by the race sanitizer while it runs, and, with the copies held, makes the
outputs differ from the serial run; a ring with a buffer per step in flight stays clean."""

from __future__ import annotations

import pytest

from readfence.backends import paged
from readfence.core import ModelConfig
from readfence.graph import LoopOptions, Policy, decode_loop, run_overlapped, run_serial
from readfence.graph.runtime import Staging, StagingRingError, check_staging

CFG = ModelConfig(layers=2, max_reqs=4, max_ctx=16)


class Queue:
    """An engine-style ring: two buffers, and a loop that waits only every other step."""

    slots, held = 2, False

    def slot(self, step):
        return step % 2

    def waited(self, step):
        return step - 2 if step % 2 == 0 and step >= 2 else (step - 3 if step >= 3 else None)


@pytest.mark.parametrize("ring, bad", [
    (Staging(1), None), (Staging(2), None), (Staging(None, in_flight=4), None), (Staging(3, in_flight=3), None),
    (Staging(1, in_flight=2), (1, 0, 0)), (Staging(2, in_flight=3), (2, 0, 0)), (Queue(), (3, 1, 1)),
])
def test_check_staging_replays_the_rings_own_answers(ring, bad):
    found = check_staging(ring)
    if bad is None:
        assert found is None
    else:
        assert isinstance(found, StagingRingError) and (found.step, found.slot, found.reader) == bad, str(found)


def test_check_staging_names_the_buffers_and_the_steps_in_flight():
    found = check_staging(Staging(2, in_flight=3))
    assert str(found) == ("step 2 refills host buffer 0, which step 0's copy reads, but the host waited for no step: "
                          "2 buffers for 3 steps in flight")


def test_bad_rings_are_refused_with_what_was_wrong(dev):
    with pytest.raises(TypeError, match="staging must be a readfence.graph.runtime.Staging or an object with slots"):
        decode_loop(paged(), policy=Policy.PER_BUFFER, device=dev, cfg=CFG, batch_size=2,
                    options=LoopOptions(staging=3))
    with pytest.raises(ValueError, match=r"Staging\(slots=None\) stages each step in a fresh buffer: give in_flight"):
        Staging(None)
    with pytest.raises(StagingRingError, match="2 buffers for 3 steps in flight"):
        decode_loop(paged(), policy=Policy.PER_BUFFER, device=dev, cfg=CFG, batch_size=2,
                    options=LoopOptions(staging=Staging(2, in_flight=3)))


def _run(dev, ring):
    return run_overlapped(paged(), steps=6, policy=Policy.PER_BUFFER, device=dev, batch_size=2, cfg=CFG,
                          options=LoopOptions(staging=ring, UNSAFE_skip_soundness_check=True))


@pytest.mark.parametrize("ring", [Staging(1, in_flight=2, held=True), Staging(2, in_flight=3, held=True)])
def test_a_ring_too_shallow_for_its_steps_in_flight_races(ring, dev):
    serial = run_serial(paged(), steps=6, batch_size=2, cfg=CFG)
    held = _run(dev, ring)
    # held copies run as late as the host's own waits allow: the refill always overtakes one
    assert not held.matches(serial)
    assert any(v.buffer.startswith("staging[") and v.writer == "<host>" for v in held.violations), held.violations
    loose = _run(dev, Staging(ring.slots, in_flight=ring.in_flight))
    assert loose.violations, "the sanitizer sees the race whatever the timing"


@pytest.mark.parametrize("ring", [Staging(1, held=True), Staging(2, held=True), Staging(None, in_flight=3, held=True)])
def test_a_ring_deep_enough_is_clean_and_matches_the_serial_run(ring, dev):
    run = _run(dev, ring)
    assert run.matches(run_serial(paged(), steps=6, batch_size=2, cfg=CFG)) and run.violations == ()
