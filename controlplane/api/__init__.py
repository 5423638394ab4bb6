"""The gRPC face of the registry: who serves a call (``interface``: this replica's registry
while it leads, else the leader); the servicer that decodes requests, serves each call on the
leader or relays it whole from a follower, and maps errors to statuses (``service``); a
follower's relay and its own hint path (``forwarder``); the conversion of records to and from
protobuf, on the leader only (``convert``); and the identity of the caller (``identity``)."""
