"""FedAMoLE (paper 002): the method (:mod:`training.algorithms.fedamole.method`) and its reverse-selection
expert assignment (RSEA: relevance and aggregation, the assignment MILP, the clients' embeddings)."""
