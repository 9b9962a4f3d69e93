"""What loom.torch's operators read of a communicator, for tests without GPUs (never launched on)."""


class StandInComm:
    """A communicator of `world` local ranks as the operators' shape functions see it."""

    def __init__(self, world: int) -> None:
        self.local_world_size = world
        self.rank = 0
        self.device = 0
