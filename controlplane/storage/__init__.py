"""Storage: where records live (memory or etcd), the cache that serves reads, group commit of
writes, and the outbox of commands that go out once a write is durable. Knows records, not the
rules that change them."""
