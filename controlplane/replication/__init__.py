"""Replication: replicas over one etcd, the election of the one that leads, and a follower's
view of the leader's state for hints while no leader answers."""
