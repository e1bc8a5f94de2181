"""The step progress channel (kvcached.memory.progress): one writer publishes a
task's layers, one reader waits for them; stale, newer, failed, cancelled and
dead-writer states, in one process and across two; the gate that makes giving
up final (a layer in flight holds it, a dead writer releases it); the layer
events' handles the channel carries on CUDA."""

from __future__ import annotations

import select
import subprocess
import sys
import time

import pytest

from kvcached.memory import progress
from kvcached.memory.progress import StepProgress


def soon(s: float = 0.05) -> float:
    return time.monotonic() + s


def test_a_state_word_holds_task_layers_and_failure():
    for task, layers, failed in ((0, 0, False), (7, 3, True), (progress.MAX_TASK_ID,
                                                               progress.MAX_LAYERS, False)):
        assert progress.unpack(progress.pack(task, layers, failed)) == (task, layers, failed)
    with pytest.raises(ValueError):
        progress.pack(progress.MAX_TASK_ID + 1, 0)
    with pytest.raises(ValueError):
        progress.pack(1, progress.MAX_LAYERS + 1)


def test_layers_are_waited_for_in_order(chan):
    reader, writer = chan
    assert reader.wait(5, 1, soon()).outcome == "timeout"  # nothing of task 5 yet
    for layer in range(1, 4):
        writer.publish(5, layer)
        assert reader.wait(5, layer, soon()) == progress.Wait("ok", layer)
        # the next layer has not landed: the wait runs out its deadline, no longer
        t0 = time.monotonic()
        res = reader.wait(5, layer + 1, soon(0.02))
        assert res == progress.Wait("timeout", layer) and time.monotonic() - t0 < 1.0
    assert reader.state() == (5, 3, False)


def test_a_failed_copy_ends_the_wait_at_once(chan):
    reader, writer = chan
    writer.publish(9, 1)
    writer.publish(9, 1, failed=True)
    assert reader.wait(9, 4, soon(10)) == progress.Wait("failed", 1)


def test_an_older_task_is_stale_and_a_newer_one_means_lost(chan):
    reader, writer = chan
    writer.publish(3, 8)  # an earlier load's layers: not this one's
    assert reader.wait(4, 1, soon()).outcome == "timeout"
    writer.publish(6, 0)  # a later task ran: task 4 never will
    t0 = time.monotonic()
    assert reader.wait(4, 1, soon(10)).outcome == "lost"
    assert time.monotonic() - t0 < 1.0


def test_a_cancelled_task_stops_the_writer_before_its_next_layer(chan):
    reader, writer = chan
    assert reader.writer_alive()  # this process
    with writer.layer_gate(11):  # a layer of task 11 copies...
        writer.publish(11, 1)
    assert reader.cancel(11, soon())  # ...then the engine gives up on it
    with pytest.raises(progress.Cancelled):
        with writer.layer_gate(11):
            pytest.fail("a layer of a cancelled task was copied")
    with writer.layer_gate(12):  # the next task copies
        writer.publish(12, 1)
    assert reader.state() == (12, 1, False)


def test_giving_up_on_a_task_gives_up_on_every_earlier_one(chan):
    """A writer that runs late (stopped before task 20 began) while the engine
    gave up on 20, then on 21, in two steps: it must copy neither."""
    reader, writer = chan
    assert reader.cancel(20, soon()) and reader.cancel(21, soon())
    assert reader.cancel(19, soon())  # an older one changes nothing
    for task in (19, 20, 21):
        with pytest.raises(progress.Cancelled):
            with writer.layer_gate(task):
                pytest.fail(f"a layer of task {task} was copied")
    with writer.layer_gate(22):
        writer.publish(22, 1)


# A writer in another process: takes the gate for a layer of task 40 and says
# "in"; copies once told "go"; leaves the gate and says "out". "die" instead of
# "go": it exits holding the gate, as a killed worker does.
GATE_WRITER = """
import os, sys
from kvcached.memory.progress import StepProgress
p = StepProgress.open(sys.argv[1])
p.attach_writer()
with p.layer_gate(40):
    print("in", flush=True)
    if sys.stdin.readline().strip() == "die":
        os._exit(0)
    p.publish(40, 1)
print("out", flush=True)
"""


@pytest.fixture
def gate_writer(tmp_path):
    path = progress.progress_path(tmp_path, 2)
    reader = StepProgress.create(path)
    proc = subprocess.Popen([sys.executable, "-c", GATE_WRITER, str(path)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert read_line(proc) == "in"
        yield reader, proc
    finally:
        proc.kill()
        proc.wait(timeout=60)
        reader.close()


def read_line(proc, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the writer said nothing in {timeout}s"
    return proc.stdout.readline().strip()


def test_giving_up_waits_for_the_layer_in_flight(gate_writer):
    """The engine cannot give up while a layer is being copied: that layer would
    land after it, on blocks computed again. cancel returns False while the
    writer holds the gate, True once the layer is done; the writer then copies
    nothing more of the task."""
    reader, proc = gate_writer
    t0 = time.monotonic()
    assert not reader.cancel(40, soon(0.1))
    assert time.monotonic() - t0 >= 0.1
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert reader.cancel(40, soon(30))
    assert reader.state() == (40, 1, False)  # the layer in flight landed before
    assert read_line(proc) == "out"


def test_a_writer_that_dies_holding_the_gate_releases_it(gate_writer):
    reader, proc = gate_writer
    proc.stdin.write("die\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0
    assert reader.cancel(40, soon(1))


def test_layer_event_handles_travel_with_the_channel(tmp_path):
    path = progress.progress_path(tmp_path, 3)
    handles = [bytes([i]) * progress.HANDLE_BYTES for i in range(3)]
    made = StepProgress.create(path, handles)
    opened = StepProgress.open(path)
    assert made.event_handles == opened.event_handles == handles
    assert StepProgress.create(tmp_path / "cpu.progress").event_handles == []
    with pytest.raises(ValueError, match="64 bytes"):
        StepProgress.create(path, [b"short"])
    path.write_bytes(path.read_bytes()[:-1])  # a handle cut short
    with pytest.raises(ValueError, match="names 3 layer events but holds 2"):
        StepProgress.open(path)
    made.close()
    opened.close()


def test_a_writer_that_dies_mid_task_ends_the_wait(tmp_path):
    """A transfer worker killed between two layers: the reader sees its pid gone
    and gives up at once, long before its deadline."""
    path = progress.progress_path(tmp_path, 1)
    reader = StepProgress.create(path)
    code = (f"from kvcached.memory.progress import StepProgress\n"
            f"p = StepProgress.open({str(path)!r}); p.attach_writer(); p.publish(21, 2)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    t0 = time.monotonic()
    assert reader.wait(21, 2, soon(10)).ok  # what landed before it died is there
    assert reader.wait(21, 3, soon(10)) == progress.Wait("lost", 2)
    assert time.monotonic() - t0 < 1.0
    assert not reader.writer_alive()
    reader.close()


def test_a_new_channel_replaces_the_old_file(chan, tmp_path):
    """A new engine makes its own channel: a worker still mapping the old file
    publishes where nobody reads."""
    reader, old_writer = chan
    fresh = StepProgress.create(progress.progress_path(tmp_path, 0))
    old_writer.publish(30, 5)
    assert fresh.state() == (0, 0, False) and fresh.writer_pid() == 0
    assert reader.state() == (30, 5, False)
    fresh.close()


def test_a_file_that_is_not_a_channel_is_refused(tmp_path):
    bad = tmp_path / "x.progress"
    bad.write_bytes(bytes(progress.SIZE))
    with pytest.raises(ValueError, match="bad magic"):
        StepProgress.open(bad)
    bad.write_bytes(b"short")
    with pytest.raises(ValueError, match="shorter"):
        StepProgress.open(bad)
