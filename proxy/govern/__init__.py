"""Per-call policy: ceilings, the loop guard, wrap-up notes, prompt-cache breakpoints, runs,
the repair driver."""
