"""``elasticctl``'s side: the job's status read from etcd, and drain requests. Torch-free."""
