"""The reward model r_phi: the model and scorer, Bradley-Terry training."""
