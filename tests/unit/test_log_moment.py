"""``log.set_moment``: the generation, rank and step of the moment on every line of every thread
(``generation_published``, logged by the coordinator's thread, names the step of that moment)."""

from __future__ import annotations

import io
import json
import threading

import structlog

from elasticd import log as elog


def test_a_thread_started_earlier_logs_the_step_set_later(monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    elog.configure_logging(json=True)
    try:
        elog.set_moment(node="n0", generation=3, rank=1, step=13)
        go, done = threading.Event(), threading.Event()

        def background() -> None:  # like the coordinator's thread: started before the steps went on
            go.wait(10)
            structlog.get_logger("t").info("generation_published", generation=4)
            done.set()

        t = threading.Thread(target=background)
        t.start()
        for step in range(14, 26):
            elog.set_moment(step=step)
        go.set()
        assert done.wait(10)
        t.join(10)
        elog.bind_context(member="m")  # this thread's own field
        structlog.get_logger("t").info("step_committed", step=26)
        lines = [json.loads(x) for x in out.getvalue().splitlines()]
        assert lines[0]["event"] == "generation_published"
        assert (lines[0]["step"], lines[0]["rank"], lines[0]["node"]) == (25, 1, "n0")
        assert lines[0]["generation"] == 4  # a field the line names itself wins
        assert lines[1]["step"] == 26 and lines[1]["member"] == "m"
    finally:
        elog.clear_context()
        structlog.reset_defaults()  # as the other tests found it
