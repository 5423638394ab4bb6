"""The rules every part shares: ids, handles and checkpoints, the routing rule, costs, retention
deadlines and values, labels, the clock and time conversions, what an engine's metrics say.
Pure: imports nothing from the client or process helpers."""
