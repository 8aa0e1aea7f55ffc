"""Loss terms shared by methods beyond the LM loss: whole-batch terms split over micro-batches, pooled features
and their distances (FedOA, FedMCP), and CKA (FedMCP)."""
