"""Host time per section, for profiling the taps' own overhead (the tap worker's and the engine's)."""


class Clock:
    """Host time per section and call counts, for profiling the taps' own overhead (and the engine's host work
    around them)."""

    def __init__(self) -> None:
        self.seconds: dict = {}
        self.calls: dict = {}

    def add(self, section: str, dt: float) -> None:
        self.seconds[section] = self.seconds.get(section, 0.0) + dt
        self.calls[section] = self.calls.get(section, 0) + 1

    def take(self) -> dict:
        out = {k: {"seconds": v, "calls": self.calls[k]} for k, v in self.seconds.items()}
        self.seconds, self.calls = {}, {}
        return out
