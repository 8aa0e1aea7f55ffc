"""The federation: the round loop written once for every runtime (:mod:`training.federation.rounds`), the
:class:`~training.federation.transport.Transport` it drives, the checks on a client's reply, aggregation and
its robust variants, checkpoints and durable files, and each client's personalization at the end."""
