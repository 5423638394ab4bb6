"""The lessor: conversation leases (grant, renew, release, revoke, expiry, claims), the reads of
them, the retention reports that grant and end them, and the turns still finishing."""
