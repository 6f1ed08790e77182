"""The tests' own etcd (``elasticd.testing.etcd.EtcdServer``): it leaves nothing behind in the
temporary directory it made."""

from __future__ import annotations

from pathlib import Path

from elasticd.testing.etcd import EtcdServer


def test_a_stopped_test_etcd_leaves_neither_its_data_nor_its_log() -> None:
    server = EtcdServer().start()
    try:
        data, log = Path(server.data_dir), server.log_path
        assert data.is_dir() and log.is_file()
        server.restart()  # a restart keeps both
        assert data.is_dir() and log.is_file()
    finally:
        server.stop()
    assert not data.exists() and not log.exists()
