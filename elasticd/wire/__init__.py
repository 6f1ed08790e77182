"""The job's etcd contract: key layout, records, codec and parsed snapshots. Pure, torch-free."""
