"""The torchrun wrapper and what it injects into workers (``ncclwatch torchrun ...``)."""
