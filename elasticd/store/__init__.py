"""Where the job's state lives: the key-value port (``kv``) and its etcd client (``etcd``)."""
