"""Config -> compiled edits: taps, vectors, the in-place edit programs, and the plan that groups them by tap."""
