"""Dev tooling shared by the tests, the demo, chaos and the benchmarks: a local etcd and cluster
(``localcluster``) and the audit-log reader (``audit``). Nothing in the library imports it."""
