"""Process helpers: child processes and their supervision, a local etcd, free ports, logging,
the metrics endpoint, task groups, and the files an operator names (TLS, credentials)."""
