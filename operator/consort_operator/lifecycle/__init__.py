"""Pure lifecycle state machines: (spec, observed, previous status, now) -> (status, events)."""
