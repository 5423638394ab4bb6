"""Sessions: node registration, heartbeats, drain and DOWN, each node's cost profile and its live
correction, and the idle TTL learnt from the gaps between turns."""
