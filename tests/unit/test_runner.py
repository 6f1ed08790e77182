"""The shell of the demo's and chaos's ``main``: how a run ended -> the exit code, then the cleanup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.testing.runner import Terminated, make_workdir, run_to_exit

pytestmark = pytest.mark.timeout(30)


def _returns(code: int) -> Callable[[], int]:
    return lambda: code


def _raises(exc: BaseException) -> Callable[[], int]:
    def body() -> int:
        raise exc

    return body


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (_returns(0), 0),
        (_returns(1), 1),
        (_raises(ConfigError("etcd: no etcd binary on PATH")), 2),
        (_raises(RuntimeError("etcd did not answer")), 1),
        (_raises(KeyboardInterrupt()), 130),
        (_raises(Terminated()), 130),
    ],
)
def test_exit_code_of_each_way_out_and_every_process_stopped(
    body: Callable[[], int], code: int, tmp_path: Path
) -> None:
    stopped: list[bool] = []
    said: list[str] = []
    workdir = tmp_path / "run"
    workdir.mkdir()
    assert run_to_exit("elasticd.test", body, lambda: stopped.append(True), workdir, True, said.append) == code
    assert stopped == [True]
    # A temporary work dir goes only when the run passed; otherwise it is kept, and said so.
    assert workdir.exists() == (code != 0)
    assert said == ([] if code == 0 else [f"work dir kept: {workdir}"])


def test_a_work_dir_given_is_kept_even_when_the_run_passed(tmp_path: Path) -> None:
    said: list[str] = []
    assert run_to_exit("elasticd.test", _returns(0), lambda: None, tmp_path, False, said.append) == 0
    assert tmp_path.exists() and said == [f"work dir kept: {tmp_path}"]


def test_make_workdir_refuses_a_non_empty_dir_and_removes_only_a_temporary_one(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    with pytest.raises(ConfigError, match="--workdir"):
        make_workdir(tmp_path, keep=False, prefix="elasticd-test-")
    given, remove = make_workdir(tmp_path / "new", keep=False, prefix="elasticd-test-")
    assert given.is_dir() and not remove
    temp, remove = make_workdir(None, keep=False, prefix="elasticd-test-")
    kept, keep_remove = make_workdir(None, keep=True, prefix="elasticd-test-")
    try:
        assert temp.is_dir() and remove
        assert kept.is_dir() and not keep_remove
    finally:
        temp.rmdir()
        kept.rmdir()
