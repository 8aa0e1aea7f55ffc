"""The Flower bridge: the ServerApp and ClientApp (:mod:`training.flower.app`), the round loop's transport over
Flower's Grid, the messages' encoding and a node's private state by version."""
