"""pFedSeq (paper 003): the method (:mod:`training.algorithms.pfedseq.method`) and its server-side sequential
learners (the update history, the selective SSM, LSTM and MLP learners, the Mamba block and its scan)."""
