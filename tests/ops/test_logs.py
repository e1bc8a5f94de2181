"""Per-process log files: repeated warnings are rate-limited, one line with a count.

A worker restart window once wrote one WARNING per failed swap (1.1 MB of log
for 10 kills); the same message template now appears REPEAT_BURST times per
window, then once more as a count.
"""

from __future__ import annotations

import logging
import time

from kvcached.ops import logs


def log_lines(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line]


def test_a_storm_of_one_warning_is_a_few_lines_and_a_count(tmp_path):
    file = logs.setup_process_logging(tmp_path, "engine")
    log = logging.getLogger("kvcached.test.storm")
    try:
        for i in range(1000):
            log.warning("swap_in for request %r failed: %s", f"r{i}", "worker lost")
        log.warning("another problem %d", 1)  # another template: not limited
        log.info("progress %d", 1)
    finally:
        logs.stop_process_logging(file)  # reports what was held back
    lines = log_lines(file)
    storm = [line for line in lines if "swap_in for request 'r" in line]
    assert len(storm) == logs.REPEAT_BURST and "'r0'" in storm[0]
    summary = [line for line in lines if "repeated" in line]
    assert len(summary) == 1 and "repeated 995 more times" in summary[0]
    assert "swap_in for request %r failed: %s" in summary[0]  # names the template
    assert "WARNING" in summary[0] and "[engine pid=" in summary[0]
    assert any("another problem 1" in line for line in lines)
    assert any("progress 1" in line for line in lines)
    assert len(lines) == logs.REPEAT_BURST + 3


def test_the_count_comes_when_the_window_is_over(tmp_path):
    handler = logging.FileHandler(tmp_path / "x.log")
    limiter = logs.RepeatLimiter(handler, window_s=0.05, burst=2)
    handler.addFilter(limiter)
    log = logging.getLogger("kvcached.test.window")
    log.addHandler(handler)
    log.propagate = False
    try:
        for _ in range(10):
            log.error("rank %d lost", 1)
        time.sleep(0.1)  # the window is over: the next record reports the count
        log.error("rank %d lost", 2)
    finally:
        log.removeHandler(handler)
        handler.close()
    lines = log_lines(tmp_path / "x.log")
    assert lines == ["rank 1 lost", "rank 1 lost",
                     lines[2], "rank 2 lost"], lines
    assert lines[2].startswith("the previous message repeated 8 more times in 0s")


def test_info_and_debug_are_never_limited(tmp_path):
    handler = logging.FileHandler(tmp_path / "x.log")
    handler.addFilter(logs.RepeatLimiter(handler, window_s=60, burst=1))
    log = logging.getLogger("kvcached.test.info")
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    log.propagate = False
    try:
        for i in range(50):
            log.info("step %d", i)
    finally:
        log.removeHandler(handler)
        handler.close()
    assert len(log_lines(tmp_path / "x.log")) == 50
