"""Records: what the registry stores (nodes, leases, conversations) and answers (``answers``),
their codec to and from protobuf and to stored bytes, lease ids, and the checks every input
passes before it becomes one.
Imports nothing above it."""
