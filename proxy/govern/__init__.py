"""Per-call policy: ceilings, the loop guard, wrap-up notes, runs, the repair driver."""
