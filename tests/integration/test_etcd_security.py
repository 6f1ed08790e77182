"""etcd with TLS (mutual: a client certificate is required) and with authentication: an agent's job
runs against it with the right settings, and ``elasticctl status`` answers with the right options
and fails clearly (exit 2) with wrong ones. The certificates are made here with the openssl CLI;
auth is enabled through etcd's gRPC Auth API (etcd3 0.12 has no helper for it; etcdctl may be
absent)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.testing.audit import check_dir
from elasticd.testing.etcd import EtcdServer, EtcdTls
from elasticd.testing.localcluster import REPO_ROOT
from tests.integration.test_node_agent import AgentJob, _worker_pid
from tests.jobs import wait_until

OPENSSL = shutil.which("openssl")
CTL = [sys.executable, "-c", "import sys; from elasticd.cli import ctl_main; sys.exit(ctl_main())"]
PROGRAM = [sys.executable, "agents/mlp.py", "--steps", "30"]
CTL_TIMEOUT_S = 30  # bound on one elasticctl run (it answers in about 2 s when etcd refuses it)


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _leaf(d: Path, name: str, ca: str, usage: str) -> None:
    """``name.pem``/``name.key``: a P-256 certificate for 127.0.0.1 signed by ``ca``."""
    (d / f"{name}.ext").write_text(
        f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"
    )
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        cwd=d,
    )


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        cwd=d,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if OPENSSL is None:
        pytest.skip("no openssl CLI to make test certificates (and the cryptography package is not installed)")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")  # signs nothing etcd trusts
    _leaf(d, "server", "ca", "serverAuth,clientAuth")
    _leaf(d, "client", "ca", "clientAuth")
    return d


@pytest.fixture
def tls_etcd(pki: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tls=EtcdTls(pki / "ca.pem", pki / "server.pem", pki / "server.key")).start()
    try:
        yield server
    finally:
        server.stop()


def _ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    base["PYTHONPATH"] = str(REPO_ROOT)
    base.update(env or {})
    return subprocess.run(
        CTL + list(args), cwd=REPO_ROOT, env=base, capture_output=True, text=True, timeout=CTL_TIMEOUT_S
    )


@pytest.mark.timeout(120)
def test_tls_a_job_runs_and_elasticctl_needs_the_right_certificates(
    tls_etcd: EtcdServer, pki: Path, tmp_path: Path
) -> None:
    tls = {"etcd_ca_cert": pki / "ca.pem", "etcd_cert_cert": pki / "client.pem", "etcd_cert_key": pki / "client.key"}
    job = AgentJob(tls_etcd, tmp_path / "job", lease_ttl_s=2, keepalive_s=0.5, **tls)
    try:
        agent = job.start("a", program=[*PROGRAM, "--audit", str(job.audit_path("a"))])
        assert agent.wait(90) == 0, job.logs_tail()  # the worker got the TLS settings from the agent
    finally:
        job.stop()
    assert len(job.commits("a")) == 30
    flags = [
        "--etcd-ca-cert",
        str(pki / "ca.pem"),
        "--etcd-cert-cert",
        str(pki / "client.pem"),
        "--etcd-cert-key",
        str(pki / "client.key"),
    ]
    ok = _ctl("--etcd", tls_etcd.endpoint, *flags, "status", "--job", job.job_id, "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["finished"], ok.stdout
    from_env = _ctl(
        "--etcd",
        tls_etcd.endpoint,
        "status",
        "--job",
        job.job_id,
        env={"ELASTICD_" + k.upper(): str(v) for k, v in tls.items()},
    )
    assert from_env.returncode == 0, from_env.stderr

    plain = _ctl("--etcd", tls_etcd.endpoint, "status", "--job", job.job_id)
    assert plain.returncode == 2 and plain.stdout == ""
    (line,) = plain.stderr.splitlines()
    assert line.startswith(f"elasticctl: etcd at {tls_etcd.endpoint} did not answer"), line
    wrong_ca = _ctl(
        "--etcd",
        tls_etcd.endpoint,
        "--etcd-ca-cert",
        str(pki / "other-ca.pem"),
        "--etcd-cert-cert",
        str(pki / "client.pem"),
        "--etcd-cert-key",
        str(pki / "client.key"),
        "status",
        "--job",
        job.job_id,
    )
    assert wrong_ca.returncode == 2
    (line,) = wrong_ca.stderr.splitlines()
    assert "did not answer" in line and "check --etcd-ca-cert" in line, line
    no_client_cert = _ctl(
        "--etcd", tls_etcd.endpoint, "--etcd-ca-cert", str(pki / "ca.pem"), "status", "--job", job.job_id
    )
    assert no_client_cert.returncode == 2, no_client_cert.stderr
    half = _ctl("--etcd", tls_etcd.endpoint, "--etcd-cert-cert", str(pki / "client.pem"), "status")
    assert half.returncode == 2
    assert half.stderr.strip() == (
        "elasticctl: etcd_cert_cert: a client certificate needs its key, and the key "
        "its certificate (set both etcd_cert_cert and etcd_cert_key, or neither)"
    )
    missing = _ctl("--etcd", tls_etcd.endpoint, "--etcd-ca-cert", str(pki / "absent.pem"), "status")
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"elasticctl: etcd_ca_cert: no such file: {str(pki / 'absent.pem')!r}"


def _enable_auth(endpoint: str, user: str, password: str, prefix: str) -> None:
    """root (with the root role), and ``user`` with read-write on ``prefix``; then auth on."""
    import elasticd.store.etcd  # noqa: F401  (first: it installs etcd3's protobuf modules)
    import etcd3
    from etcd3 import etcdrpc
    from etcd3.etcdrpc import auth_pb2

    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        auth = etcdrpc.AuthStub(client.channel)
        auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), 5)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="root-secret"), 5)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), 5)
        auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="trainer"), 5)
        perm = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=f"{prefix}/".encode(), range_end=f"{prefix}0".encode()
        )
        auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name="trainer", perm=perm), 5)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password), 5)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role="trainer"), 5)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), 5)
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_auth_a_job_runs_as_its_user_and_elasticctl_needs_the_password(tmp_path: Path) -> None:
    server = EtcdServer().start()
    try:
        _enable_auth(server.endpoint, "trainer1", "s3cret-pw", "/elasticd")
        password_file = tmp_path / "etcd-password"
        password_file.write_text("s3cret-pw\n")
        job = AgentJob(
            server,
            tmp_path / "job",
            lease_ttl_s=2,
            keepalive_s=0.5,
            etcd_user="trainer1",
            etcd_password_file=password_file,
        )
        try:
            agent = job.start("a", program=[*PROGRAM, "--audit", str(job.audit_path("a"))])
            assert agent.wait(90) == 0, job.logs_tail()
        finally:
            job.stop()
        assert len(job.commits("a")) == 30
        assert "s3cret-pw" not in job.agents["a"].log_text()  # never logged
        ok = _ctl(
            "--etcd",
            server.endpoint,
            "--etcd-user",
            "trainer1",
            "--etcd-password-file",
            str(password_file),
            "status",
            "--job",
            job.job_id,
            "--json",
        )
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["finished"]
        via_env = _ctl(
            "--etcd",
            server.endpoint,
            "--etcd-user",
            "trainer1",
            "status",
            "--job",
            job.job_id,
            env={"ELASTICD_ETCD_PASSWORD": "s3cret-pw"},
        )
        assert via_env.returncode == 0, via_env.stderr

        wrong = _ctl(
            "--etcd",
            server.endpoint,
            "--etcd-user",
            "trainer1",
            "status",
            "--job",
            job.job_id,
            env={"ELASTICD_ETCD_PASSWORD": "WRONG-pw"},
        )
        assert wrong.returncode == 2 and wrong.stdout == ""
        (line,) = wrong.stderr.splitlines()
        assert "rejected the credentials of user 'trainer1'" in line and "check --etcd-user" in line, line
        assert "WRONG-pw" not in line  # the password is never echoed
        anonymous = _ctl("--etcd", server.endpoint, "status", "--job", job.job_id)
        assert anonymous.returncode == 2
        (line,) = anonymous.stderr.splitlines()
        assert "rejected" in line, line
        no_password = _ctl("--etcd", server.endpoint, "--etcd-user", "trainer1", "status")
        assert no_password.returncode == 2
        assert no_password.stderr.startswith("elasticctl: etcd_user: a user needs a password"), no_password.stderr
    finally:
        server.stop()


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(150)
def test_auth_a_worker_started_while_etcd_is_down_waits_for_it_and_spends_no_restart(tmp_path: Path) -> None:
    """With a user, etcd3 authenticates as it makes its client: a worker its agent restarted during an
    etcd outage exited at once (EtcdUnavailable), and the agent spent its restart budget on the
    outage (with max_restarts 1: it gave up). The client now connects at its first call, which waits
    for etcd as every call does (up to etcd_outage_s)."""
    server = EtcdServer().start()
    job = None
    try:
        _enable_auth(server.endpoint, "trainer1", "s3cret-pw", "/elasticd")
        password_file = tmp_path / "etcd-password"
        password_file.write_text("s3cret-pw\n")
        job = AgentJob(
            server,
            tmp_path / "job",
            lease_ttl_s=2,
            keepalive_s=0.5,
            etcd_user="trainer1",
            etcd_password_file=password_file,
            max_restarts=1,
        )
        a = job.start("a", "--nnodes", "1:2", steps=250)
        b = job.start("b", "--nnodes", "1:2", steps=250)
        job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
        victim = _worker_pid(b)
        server.kill()  # the data dir stays: the same etcd comes back below
        os.kill(victim, signal.SIGKILL)
        job.wait_for(lambda: len(b.events("worker_started")) == 2, 30, "b to restart its worker during the outage")
        wait_until(
            lambda: b.events("etcd_not_answering_at_start") or b.proc.poll() is not None,
            30,
            "the restarted worker to meet the outage",
            job.logs_tail,
        )
        assert b.proc.poll() is None, job.logs_tail()
        assert not b.events("restarts_exhausted")
        server.start()
        assert a.wait(120) == 0, job.logs_tail()
        assert b.wait(60) == 0, job.logs_tail()
        assert len(b.events("worker_started")) == 2 and b.events("etcd_connected_late"), job.logs_tail()
        rep = check_dir(job.dir, 2048)
        assert rep.ok, rep.violations
        assert rep.last_step == 250
    finally:
        if job is not None:
            job.stop()
        server.stop()


# -- https:// means TLS --------------------------------------------------------------------------


def _not_plaintext(proc: subprocess.CompletedProcess[str], endpoint: str) -> str:
    """The one line of an elasticctl that did not talk to ``endpoint``: its TLS was refused, or (on a
    machine without a CA bundle) it had none to use. Never a plaintext answer."""
    assert proc.returncode == 2 and proc.stdout == "", proc
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"elasticctl: etcd at {endpoint} did not answer") or line.startswith(
        "elasticctl: etcd_ca_cert: the etcd endpoints are https://"
    ), line
    return line


@pytest.mark.timeout(60)
def test_https_to_a_plaintext_etcd_talks_tls_or_nothing(etcd_server: EtcdServer) -> None:
    """The scheme was dropped: elasticctl talked plaintext and reported 'no such job'."""
    endpoint = f"https://{etcd_server.endpoint}"
    line = _not_plaintext(_ctl("--etcd", endpoint, "status", "--job", "nojob"), endpoint)
    assert "no such job" not in line


@pytest.mark.timeout(120)
def test_https_without_a_ca_file_trusts_the_system_ca_bundle(
    tls_etcd: EtcdServer, pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``https://`` and no ``etcd_ca_cert``: TLS with the system's CA bundle, for the agent, its workers
    and elasticctl. The test CA is made the system's by ``SSL_CERT_FILE`` (OpenSSL's override of its
    default bundle); without it, the real system bundle does not trust etcd's certificate."""
    endpoint = f"https://{tls_etcd.endpoint}"
    client_cert = ["--etcd-cert-cert", str(pki / "client.pem"), "--etcd-cert-key", str(pki / "client.key")]
    untrusted = _ctl("--etcd", endpoint, *client_cert, "status", "--job", "nojob")
    line = _not_plaintext(untrusted, endpoint)
    if "did not answer" in line:
        assert "must be signed by a CA the system trusts" in line, line

    monkeypatch.setenv("SSL_CERT_FILE", str(pki / "ca.pem"))  # inherited by the agent and its workers
    job = AgentJob(
        tls_etcd,
        tmp_path / "job",
        lease_ttl_s=2,
        keepalive_s=0.5,
        etcd_cert_cert=pki / "client.pem",
        etcd_cert_key=pki / "client.key",
    )
    try:
        agent = job.start(
            "a",
            "--etcd",
            endpoint,  # the last --etcd wins
            program=[*PROGRAM[:-1], "10", "--audit", str(job.audit_path("a"))],
        )
        assert agent.wait(90) == 0, job.logs_tail()
    finally:
        job.stop()
    assert len(job.commits("a")) == 10
    ok = _ctl("--etcd", endpoint, *client_cert, "status", "--job", job.job_id, "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["finished"], ok.stdout


# -- per-job credentials --------------------------------------------------------------------------


def _denied(proc: subprocess.CompletedProcess[str], job: str, user: str) -> None:
    """elasticctl's one line for a user whose role does not cover ``job``; exit 2, as a bad setting."""
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines() == [
        f"elasticctl: permission denied for job {job} (etcd user {user}): the user's role does not cover "
        f"/elasticd/{job}/ -- see `elasticctl auth setup-job`"
    ], proc.stderr


@pytest.mark.timeout(180)
def test_per_job_roles_let_each_job_reach_only_its_own_keys(tmp_path: Path) -> None:
    """``elasticctl auth setup-job`` as root makes jobA's and jobB's roles and users (twice: nothing
    changes); job A runs as its user; B's user gets the clear permission-denied error on job A, from
    elasticctl (status, drain, events), from an agent, and through the store, never etcd_unreachable."""
    from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
    from elasticd.errors import PermissionDenied
    from elasticd.store.etcd import EtcdClient
    from elasticd.wire.keys import Keys

    server = EtcdServer().start()
    try:
        _enable_auth(server.endpoint, "trainer1", "s3cret-pw", "/elasticd")  # root, with password root-secret
        root_pw, a_pw, b_pw = tmp_path / "root-pw", tmp_path / "a-pw", tmp_path / "b-pw"
        for path, secret in ((root_pw, "root-secret"), (a_pw, "a-secret"), (b_pw, "b-secret")):
            path.write_text(secret + "\n")
        etcd = ["--etcd", server.endpoint]
        root = [*etcd, "--etcd-user", "root", "--etcd-password-file", str(root_pw)]
        for run in range(2):  # the second run finds everything in place
            for job, pw in (("jobA", a_pw), ("jobB", b_pw)):
                done = _ctl(*root, "auth", "setup-job", job, "--password-file", str(pw))
                assert done.returncode == 0 and done.stderr == "", done
                lines = done.stdout.splitlines()
                made, granted = ("created", "granted") if run == 0 else ("exists", "already granted")
                assert lines[0] == (
                    f"role elasticd-{job}: {made}; read-write on [/elasticd/{job}/, /elasticd/{job}0) {granted}"
                )
                assert (
                    f"elasticctl --etcd {server.endpoint} --etcd-user {job} --etcd-password-file {pw} status "
                    f"--job {job}"
                ) in done.stdout
                assert "warning" not in done.stdout
        as_a = [*etcd, "--etcd-user", "jobA", "--etcd-password-file", str(a_pw)]
        as_b = [*etcd, "--etcd-user", "jobB", "--etcd-password-file", str(b_pw)]

        job = AgentJob(
            server, tmp_path / "job", lease_ttl_s=2, keepalive_s=0.5, etcd_user="jobA", etcd_password_file=a_pw
        )
        job.job_id = "jobA"
        try:
            agent = job.start("a", program=[*PROGRAM[:-1], "10", "--audit", str(job.audit_path("a"))])
            assert agent.wait(90) == 0, job.logs_tail()
        finally:
            job.stop()
        assert len(job.commits("a")) == 10
        ok = _ctl(*as_a, "status", "--job", "jobA", "--json")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["finished"]

        _denied(_ctl(*as_b, "status", "--job", "jobA"), "jobA", "jobB")
        _denied(_ctl(*as_b, "drain", "a", "--job", "jobA"), "jobA", "jobB")
        _denied(_ctl(*as_b, "events", "--job", "jobA"), "jobA", "jobB")
        _denied(_ctl(*as_a, "status", "--job", "jobB"), "jobB", "jobA")
        own = _ctl(*as_b, "status", "--job", "jobB")  # its own job: readable (and empty)
        assert own.returncode == 2 and "no such job" in own.stdout, own

        intruder = AgentJob(
            server, tmp_path / "intruder", lease_ttl_s=2, keepalive_s=0.5, etcd_user="jobB", etcd_password_file=b_pw
        )
        intruder.job_id = "jobA"
        try:
            b_agent = intruder.start("b", program=[*PROGRAM[:-1], "10"])
            assert b_agent.wait(30) == 2, intruder.logs_tail()
        finally:
            intruder.stop()
        log_text = intruder.agents["b"].log_text()
        assert (
            "elasticd: permission denied for job jobA (etcd user jobB): the user's role does not cover "
            "/elasticd/jobA/ -- see `elasticctl auth setup-job`"
        ) in log_text, log_text[-3000:]
        assert "etcd_unreachable" not in log_text and "worker_started" not in log_text

        client = EtcdClient(
            EtcdConfig(endpoints=(server.endpoint,), user="jobB", password_file=str(b_pw)), Timeouts(), RetryPolicy()
        )
        try:
            for attempt in (
                lambda: client.get(Keys("/elasticd", "jobA").generation),
                lambda: client.put("/elasticd/jobA/intruder", b"x"),
                lambda: client.compare_and_put("/elasticd/jobA/intruder", 0, b"x"),
                lambda: client.watch_prefix("/elasticd/jobA/", lambda: None),
            ):
                with pytest.raises(PermissionDenied, match=r"^permission denied for job jobA \(etcd user jobB\)"):
                    attempt()
            client.put("/elasticd/jobB/mine", b"x")  # its own keys: fine
            mine = client.get("/elasticd/jobB/mine")
            assert mine is not None and mine.value == b"x"
        finally:
            client.close()

        not_root = _ctl(*as_b, "auth", "setup-job", "jobC")
        assert not_root.returncode == 1 and not_root.stdout == ""
        assert not_root.stderr == (
            "elasticctl: etcd user jobB may not manage users and roles: a job's credentials "
            "are set up as etcd's root user (--etcd-user root)\n"
        )
        generated = _ctl(*root, "auth", "setup-job", "jobC", "--user", "trainer-c")
        assert generated.returncode == 0, generated.stderr
        lines = generated.stdout.splitlines()
        password = lines[lines.index(next(x for x in lines if x.startswith("password of user trainer-c"))) + 1].strip()
        as_c = _ctl(
            *etcd, "--etcd-user", "trainer-c", "status", "--job", "jobC", env={"ELASTICD_ETCD_PASSWORD": password}
        )
        assert as_c.returncode == 2 and "no such job" in as_c.stdout, as_c  # read, and found nothing yet
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_setup_job_refuses_clearly_when_etcd_authentication_is_off(etcd_server: EtcdServer, tmp_path: Path) -> None:
    root_pw = tmp_path / "root-pw"
    root_pw.write_text("root-secret\n")
    off = _ctl(
        "--etcd",
        etcd_server.endpoint,
        "--etcd-user",
        "root",
        "--etcd-password-file",
        str(root_pw),
        "auth",
        "setup-job",
        "jobA",
    )
    assert off.returncode == 1 and off.stdout == ""
    assert off.stderr.startswith(
        "elasticctl: etcd's authentication is not enabled, so a job's role would restrict nothing"
    ), off.stderr
