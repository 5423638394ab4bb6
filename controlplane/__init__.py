"""The kvbroker registry: node sessions, conversation leases and routing hints over gRPC.

The map, one line per part, lowest layer first; a part imports only the parts above it in
this list (``tests/test_layers.py`` checks it):

- ``errors``, ``config``, ``metrics``, ``deadlines``: what every part shares: typed errors, the
  settings, the Prometheus metrics, the one heap of deadlines of every kind.
- ``records/``: the stored records, what calls answer, their codec, lease ids, the checks on
  every input.
- ``storage/``: where records live (memory, etcd), the read cache, group commit, the outbox.
- ``context``: what every part below the facade shares (store, settings, clock, ...), given once.
- ``sessions/``: node sessions, their costs and live correction, the learnt idle TTL.
- ``lessor/``: leases and conversations, their reads, retention reports, turns in flight.
- ``placement/``: routing hints, the planner's cost rule, prefix caches on prefill nodes.
- ``registry``: the facade: one lock and one commit around every change the parts make; it
  takes and answers records.
- ``replication/``: replicas over etcd, the election, a follower's view of the leader.
- ``api/``: the gRPC servicer (served on the leader, relayed whole by a follower), protobuf
  to and from records, caller identity.
- ``server``: the process: a standalone registry or a replica, its gRPC server and metrics.
"""
