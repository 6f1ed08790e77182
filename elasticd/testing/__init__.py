"""Dev tooling shared by the tests, the demo, chaos and the benchmarks: a local etcd (``etcd``), the
processes of a local job (``localcluster``), the shell of a demo's or chaos run's ``main``
(``runner``) and the audit-log reader (``audit``). Nothing in the library imports it."""
