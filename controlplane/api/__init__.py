"""The gRPC face of the registry: its calls as one interface (``interface``) that the leader's
registry serves and a follower's ``forwarder`` sends to the leader; the conversion of records
to and from protobuf (``convert``); the servicer that decodes requests, makes each call and
maps errors to statuses (``service``); and the identity of the caller (``identity``)."""
