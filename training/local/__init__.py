"""The local trainer: the runtime a client trains in, its regime and budget, the training loop, the labelled-
positions forward, length-grouped micro-batches and packed rows."""
