"""Per-job etcd credentials without an etcd: the role's name and key range (``store.auth``), and the
text and exit codes of ``elasticctl auth setup-job`` (``ops.jobauth``) on bad input. The roles
themselves, against a real etcd with authentication on: tests/integration/test_etcd_security.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from elasticd.cli import ctl_main
from elasticd.config import EtcdConfig
from elasticd.ops.jobauth import SetupJobQuery, render_setup, run_setup_job
from elasticd.store.auth import READWRITE, JobAccess, describe_permission, job_key_range, range_end, role_name
from elasticd.testing.localcluster import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("key", "end"),
    [
        (b"/elasticd/jobA/", b"/elasticd/jobA0"),
        (b"a", b"b"),
        (b"a\xff", b"b"),  # a trailing 0xff is dropped, the byte before it incremented
        (b"a\xfe", b"a\xff"),
        (b"\xff\xff", b"\0"),  # nothing to increment: every key from here on
        (b"", b"\0"),
    ],
)
def test_range_end_is_etcds_prefix_end(key: bytes, end: bytes) -> None:
    assert range_end(key) == end


def test_a_jobs_range_holds_exactly_its_keys() -> None:
    start, end = job_key_range("/elasticd", "jobA")
    assert (start, end) == ("/elasticd/jobA/", "/elasticd/jobA0")
    for key in ("/elasticd/jobA/", "/elasticd/jobA/generation", "/elasticd/jobA/members/n.0.1", "/elasticd/jobA/~"):
        assert start <= key < end, key
    for key in (
        "/elasticd/jobA",
        "/elasticd/jobAB/generation",
        "/elasticd/jobA.1/x",
        "/elasticd/jobA0",
        "/elasticd/jobB/generation",
        "/elasticd/",
        "/other/jobA/generation",
    ):
        assert not start <= key < end, key
    assert job_key_range("/a/b", "j-1.x") == ("/a/b/j-1.x/", "/a/b/j-1.x0")


def test_role_name() -> None:
    assert role_name("jobA") == "elasticd-jobA"


@pytest.mark.parametrize(
    ("perm", "text"),
    [
        ((READWRITE, b"/elasticd/", b"/elasticd0"), "READWRITE [/elasticd/, /elasticd0)"),
        ((0, b"/elasticd/a/k", b""), "READ /elasticd/a/k"),
        ((1, b"/", b"\0"), "WRITE every key from / on"),
    ],
)
def test_describe_permission(perm: tuple[int, bytes, bytes], text: str) -> None:
    assert describe_permission(*perm) == text


def _access(**changes: object) -> JobAccess:
    fields: dict[str, object] = dict(
        job="jobA",
        user="jobA",
        role="elasticd-jobA",
        key="/elasticd/jobA/",
        range_end="/elasticd/jobA0",
        role_created=True,
        permission_granted=True,
        user_created=True,
        password_set=False,
        role_granted=True,
    )
    fields.update(changes)
    return JobAccess(**fields)  # type: ignore[arg-type]


def test_render_a_new_job_with_a_generated_password() -> None:
    text = render_setup(_access(generated_password="pw-123"), EtcdConfig(endpoints=("10.0.0.1:2379",)), "")
    assert text.splitlines()[:3] == [
        "role elasticd-jobA: created; read-write on [/elasticd/jobA/, /elasticd/jobA0) granted",
        "user jobA: created with a generated password",
        "user jobA: role elasticd-jobA granted",
    ]
    assert "\n  pw-123\n" in text
    assert (
        "  elasticd --etcd-endpoints 10.0.0.1:2379 --job-id jobA --etcd-user jobA --etcd-password-file "
        "PASSWORD_FILE -- PROGRAM [ARGS...]\n"
    ) in text
    assert text.endswith(
        "  elasticctl --etcd 10.0.0.1:2379 --etcd-user jobA --etcd-password-file PASSWORD_FILE status --job jobA\n"
    )
    assert "warning" not in text


def test_render_a_second_run_says_nothing_changed_and_warns_of_wider_grants() -> None:
    access = _access(
        role_created=False,
        permission_granted=False,
        user_created=False,
        role_granted=False,
        other_permissions=("READWRITE [/elasticd/, /elasticd0)",),
        other_roles=("trainer",),
    )
    text = render_setup(access, EtcdConfig(), "")
    assert text.splitlines()[:5] == [
        "role elasticd-jobA: exists; read-write on [/elasticd/jobA/, /elasticd/jobA0) already granted",
        "user jobA: exists; password unchanged (give --password-file to set it)",
        "user jobA: role elasticd-jobA already granted",
        "warning: role elasticd-jobA also grants READWRITE [/elasticd/, /elasticd0): its users reach beyond "
        "/elasticd/jobA/",
        "warning: user jobA also has the role(s) trainer: it may reach beyond /elasticd/jobA/",
    ]
    assert "password of user" not in text


def test_render_names_the_password_file_prefix_ca_and_insecure() -> None:
    etcd = EtcdConfig(endpoints=("h1:2379", "h2:2379"), prefix="/p", ca_cert="/etc/ca.pem", insecure=True)
    text = render_setup(_access(user_created=False, password_set=True), etcd, "/etc/elasticd/jobA.pw")
    assert "user jobA: exists; password set to the one in /etc/elasticd/jobA.pw" in text
    assert (
        "elasticd --etcd-endpoints h1:2379,h2:2379 --etcd-prefix /p --etcd-ca-cert /etc/ca.pem --insecure "
        "--job-id jobA --etcd-user jobA --etcd-password-file /etc/elasticd/jobA.pw -- "
    ) in text
    assert (
        "elasticctl --etcd h1:2379,h2:2379 --prefix /p --etcd-ca-cert /etc/ca.pem --insecure --etcd-user jobA "
        "--etcd-password-file /etc/elasticd/jobA.pw status --job jobA"
    ) in text


ROOT = EtcdConfig(user="root", password="root-pw")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (
            SetupJobQuery(EtcdConfig(), "jobA", "jobA"),
            "setting up a job's credentials needs etcd's root user: --etcd-user root and --etcd-password-file FILE",
        ),
        (SetupJobQuery(ROOT, "jobA", "root"), "user: root is etcd's administrator; give the job a user of its own"),
        (SetupJobQuery(ROOT, "../x", "u"), "job: must be 1 to 128 of the characters"),
        (SetupJobQuery(ROOT, "jobA", "a b"), "user: must be 1 to 128 of the characters"),
        (SetupJobQuery(ROOT, "jobA", "jobA", password_file="/nonexistent/pw"), "--password-file: cannot read"),
    ],
)
def test_bad_input_is_exit_2_before_etcd_is_asked(query: SetupJobQuery, message: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert run_setup_job(query, out, err) == 2
    assert out.getvalue() == ""
    assert err.getvalue().startswith(f"elasticctl: {message}"), err.getvalue()
    assert len(err.getvalue().splitlines()) == 1


def test_an_empty_password_file_is_bad_input(tmp_path: Path) -> None:
    empty = tmp_path / "pw"
    empty.write_text("\n")
    err = io.StringIO()
    assert run_setup_job(SetupJobQuery(ROOT, "jobA", "jobA", password_file=str(empty)), io.StringIO(), err) == 2
    assert err.getvalue() == f"elasticctl: --password-file: the first line of {str(empty)!r} is empty\n"


def test_etcd_that_does_not_answer_is_exit_1() -> None:
    query = SetupJobQuery(
        EtcdConfig(endpoints=(f"127.0.0.1:{free_port()}",), user="root", password="pw"), "jobA", "jobA"
    )
    err = io.StringIO()
    assert run_setup_job(query, io.StringIO(), err) == 1
    assert err.getvalue().startswith("elasticctl: etcd at 127.0.0.1:"), err.getvalue()


@pytest.mark.parametrize(
    "argv",
    [
        ["auth", "setup-job", "../x"],
        ["auth", "setup-job", "jobA", "--user", "a/b"],
        ["auth", "setup-job", "jobA", "--prefix", "no-slash"],
        ["auth", "setup-job"],
        ["auth"],
    ],
)
def test_the_command_line_is_checked_by_argparse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ctl_main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().out == ""


def test_the_subcommand_prefix_wins_over_the_global_one(tmp_path: Path) -> None:
    """``--prefix`` after ``setup-job`` is the one used; without it, the global one (checked through the
    message of a user that may not be root: no etcd is asked)."""
    from elasticd.cli import build_ctl_parser, setup_job_query

    parser = build_ctl_parser()
    pw = tmp_path / "pw"
    pw.write_text("x\n")
    base = ["--etcd-user", "root", "--etcd-password-file", str(pw), "--prefix", "/global"]
    q = setup_job_query(parser.parse_args([*base, "auth", "setup-job", "jobA", "--prefix", "/mine"]))
    assert (q.etcd.prefix, q.job, q.user, q.password_file) == ("/mine", "jobA", "jobA", "")
    q = setup_job_query(
        parser.parse_args([*base, "auth", "setup-job", "jobA", "--user", "u1", "--password-file", "/f"])
    )
    assert (q.etcd.prefix, q.user, q.password_file, q.etcd.user) == ("/global", "u1", "/f", "root")
